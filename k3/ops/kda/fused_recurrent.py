"""`fused_recurrent_kda`: the KDA decode step as one Triton kernel (one or a few tokens, many sequences).

Decode is bound by the state's bytes: each step reads and writes S [H, K, V] per sequence, so the kernel touches
S exactly once per call, whatever the number of tokens, and fuses everything else (gate, q/k L2 norms, β sigmoid)
into the same pass. States live in a pool [slots, H, K, V] addressed by an index per sequence (continuous
batching) and are updated in place; a negative index marks a padding row that is skipped. For speculative
decoding the multi-token mode also returns the state after every position, so a rejected suffix can be rolled
back by copying one of them. The math is docs/kda.md §2, token by token, exactly as `naive_recurrent_kda`.

Legend: N sequences, T tokens per sequence, H heads, K key dim, V value dim, BV value block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops import interpreting, triton_runs_on
from k3.ops.kda.chunk_common import _cast
from k3.ops.kda.tuning import TUNING


@triton.jit
def _recurrent(q, k, v, z, b, A_log, dt_bias, state, idx, o, all_states, scale, slot_stride,
               T: tl.constexpr, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
               G_MIN: tl.constexpr, KEEP_ALL: tl.constexpr, INTERP: tl.constexpr):
    """One (value block, sequence, head): T recurrence steps with S [K, BV] in registers."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    n = i_nh // H
    i_h = i_nh % H
    slot = tl.load(idx + n).to(tl.int64)
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    if slot < 0:
        for t in tl.static_range(T):
            tl.store(o + ((n * T + t) * H + i_h) * V + cv, tl.zeros([BV], dtype=o.dtype.element_ty))
        return
    off_s = ck[:, None] * V + cv[None, :]
    p_s = state + slot * slot_stride + i_h * K * V + off_s
    S = tl.load(p_s).to(tl.float32)  # [K, BV]
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    bias = tl.load(dt_bias + i_h * K + ck).to(tl.float32)
    for t in tl.static_range(T):
        row = (n * T + t).to(tl.int64) * H + i_h
        qt = tl.load(q + row * K + ck).to(tl.float32)
        kt = tl.load(k + row * K + ck).to(tl.float32)
        zt = tl.load(z + row * K + ck).to(tl.float32)
        vt = tl.load(v + row * V + cv).to(tl.float32)
        beta = tl.sigmoid(tl.load(b + row).to(tl.float32))
        qt = qt / tl.sqrt(tl.sum(qt * qt, 0) + 1e-6) * scale
        kt = kt / tl.sqrt(tl.sum(kt * kt, 0) + 1e-6)
        g = G_MIN * tl.sigmoid(a * (zt + bias))
        S = S * tl.exp(g)[:, None]
        u = beta * (vt - tl.sum(S * kt[:, None], 0))  # the delta-rule write, [BV]
        S = S + kt[:, None] * u[None, :]
        tl.store(o + row * V + cv, _cast(tl.sum(S * qt[:, None], 0), o.dtype.element_ty, INTERP))
        if KEEP_ALL:
            tl.store(all_states + (row * K).to(tl.int64) * V + off_s, S)
    tl.store(p_s, _cast(S, state.dtype.element_ty, INTERP))


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor | None = None,
    gate_lower_bound: float = -5.0,
    scale: float | None = None,
    return_all_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode T tokens (T small) for N sequences on raw inputs, updating their states in place.

    q, k, z: [N, T, H, K] (q, k after conv + SiLU, not normalised; z before dt_bias); v: [N, T, H, V];
    beta_logits: [N, T, H]; A_log: [H]; dt_bias: [H*K] or [H, K]. state: the pool [slots, H, K, V]
    (fp32 or bf16; each slot contiguous, slots at any stride, e.g. views into the engine's pages), row state_indices[n] ([N] int, default arange(N)) is sequence n's state; it is read,
    advanced by the T tokens and written back. A negative index skips the sequence (its o is 0).
    Returns o [N, T, H, V] in v's dtype and, with return_all_states, the fp32 state after every token
    [N, T, H, K, V] (for rolling back rejected speculative tokens). Inference only: no autograd.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [N, T, H, K], got shape {tuple(q.shape)}")
    N, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or z.shape != q.shape or v.shape[:3] != q.shape[:3] or beta_logits.shape != q.shape[:3]:
        raise ValueError("k, z must match q [N, T, H, K]; v must be [N, T, H, V]; beta_logits [N, T, H]")
    if state.dim() != 4 or state.shape[1:] != (H, K, V):
        raise ValueError(f"state must be [slots, {H}, {K}, {V}], got {tuple(state.shape)}")
    if state.stride()[1:] != (K * V, V, 1):
        raise ValueError("each state slot must be contiguous (it is updated in place); slots may be strided")
    if A_log.numel() != H or dt_bias.numel() != H * K:
        raise ValueError(f"A_log must have {H} and dt_bias {H * K} entries")
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d > 256 or d & (d - 1):
            raise ValueError(f"{name} must be a power of two in [16, 256], got {d}")
    if not triton_runs_on(q):
        raise RuntimeError("fused_recurrent_kda runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1")
    if state_indices is None:
        if state.shape[0] < N:
            raise ValueError(f"state has {state.shape[0]} slots for {N} sequences")
        state_indices = torch.arange(N, device=q.device)
    elif state_indices.shape != (N,):
        raise ValueError(f"state_indices must be [N] = [{N}], got {tuple(state_indices.shape)}")
    state_indices = state_indices.to(torch.int32).contiguous()
    scale = K**-0.5 if scale is None else float(scale)
    o = torch.empty(N, T, H, V, dtype=v.dtype, device=q.device)
    all_states = torch.empty(N, T, H, K, V, dtype=torch.float32, device=q.device) if return_all_states else o
    BV = min(V, TUNING["decode_bv"])
    if N * T > 0:
        _recurrent[(V // BV, N * H)](q.contiguous(), k.contiguous(), v.contiguous(), z.contiguous(),
                                     beta_logits.contiguous(), A_log.contiguous(), dt_bias.reshape(-1).contiguous(),
                                     state, state_indices, o, all_states, scale, state.stride(0), T=T, H=H, K=K, V=V, BV=BV,
                                     G_MIN=float(gate_lower_bound), KEEP_ALL=return_all_states,
                                     INTERP=interpreting(), num_warps=TUNING["decode_warps"])
    return o, (all_states if return_all_states else None)
