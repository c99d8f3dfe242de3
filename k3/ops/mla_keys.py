"""MLA's per-head keys and values from the decompressed latent, for the expanded (training, prefill) attention.

Legend: R rows (tokens, B·S), H heads, N nope dim, P the shared 64-channel part of the key ("rope" in the
checkpoint; NoPE in K3, so never rotated), Vd value head dim.

    kv   = kv_b_proj(ĉ)               [R, H, N + Vd]    (one GEMM; its output rows hold k_nope and v per head)
    k    = [k_nope ; k_pe] per head   [R, H, N + P]     (k_pe [R, P] the same for every head)
    v                                 [R, H, Vd]

The reference (`naive_expand_keys`) is `torch.cat` with k_pe broadcast over heads, plus a copy making v
contiguous; autograd's backward of the kv split is another cat. Those strided copies ran well below the
bandwidth their bytes need (docs/fast-paths.md). The Triton pair writes k and v in one pass, and the backward writes
d(kv) and dk_pe (the sum over heads, in fp32) in one pass.
"""

from __future__ import annotations

import torch

from k3.ops import triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def naive_expand_keys(kv: torch.Tensor, k_pe: torch.Tensor, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [..., H, N + Vd], k_pe [..., P] -> (k [..., H, N + P] in kv's dtype, v [..., H, Vd] contiguous)."""
    k_nope, v = kv.split([nope_dim, kv.shape[-1] - nope_dim], dim=-1)
    shared = k_pe.to(kv.dtype)[..., None, :].expand(*kv.shape[:-1], k_pe.shape[-1])
    return torch.cat([k_nope, shared], dim=-1), v.contiguous()


if triton is not None:

    @triton.jit
    def _expand_keys_fwd_kernel(KV, KPE, K, V, R, stride_kv, stride_pe, H: tl.constexpr, N: tl.constexpr,
                                P: tl.constexpr, VD: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
                                BV: tl.constexpr, BLOCK_R: tl.constexpr):
        # one head of BLOCK_R rows: k_nope and v from the GEMM's row, k_pe from the latent
        h = tl.program_id(1)
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        in_r = rows < R
        n, p, v = tl.arange(0, BN), tl.arange(0, BP), tl.arange(0, BV)
        kv_row = KV + rows[:, None] * stride_kv + h * (N + VD)
        k_row = K + rows[:, None] * (H * (N + P)) + h * (N + P)
        mask = in_r[:, None] & (n[None, :] < N)
        tl.store(k_row + n[None, :], tl.load(kv_row + n[None, :], mask=mask), mask=mask)
        mask = in_r[:, None] & (p[None, :] < P)
        pe = tl.load(KPE + rows[:, None] * stride_pe + p[None, :], mask=mask)
        tl.store(k_row + N + p[None, :], pe, mask=mask)
        mask = in_r[:, None] & (v[None, :] < VD)
        tl.store(V + rows[:, None] * (H * VD) + h * VD + v[None, :], tl.load(kv_row + N + v[None, :], mask=mask),
                 mask=mask)

    @triton.jit
    def _expand_keys_bwd_kernel(DK, DV, DKV, DPE, R, H: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
                                VD: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, BV: tl.constexpr,
                                BLOCK_R: tl.constexpr):
        # BLOCK_R rows, every head: d(kv) = [dk_nope ; dv] per head, dk_pe = Σ_h dk[:, h, N:]
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        in_r = rows < R
        n, p, v = tl.arange(0, BN), tl.arange(0, BP), tl.arange(0, BV)
        mask_n = in_r[:, None] & (n[None, :] < N)
        mask_p = in_r[:, None] & (p[None, :] < P)
        mask_v = in_r[:, None] & (v[None, :] < VD)
        dpe = tl.zeros([BLOCK_R, BP], dtype=tl.float32)
        for h in range(H):
            dk_row = DK + rows[:, None] * (H * (N + P)) + h * (N + P)
            dkv_row = DKV + rows[:, None] * (H * (N + VD)) + h * (N + VD)
            dk_nope = tl.load(dk_row + n[None, :], mask=mask_n)
            tl.store(dkv_row + n[None, :], dk_nope.to(DKV.dtype.element_ty), mask=mask_n)
            dv = tl.load(DV + rows[:, None] * (H * VD) + h * VD + v[None, :], mask=mask_v)
            tl.store(dkv_row + N + v[None, :], dv.to(DKV.dtype.element_ty), mask=mask_v)
            dpe += tl.load(dk_row + N + p[None, :], mask=mask_p, other=0.0).to(tl.float32)
        tl.store(DPE + rows[:, None] * P + p[None, :], dpe, mask=mask_p)


# rows per program: forward (one head each) and backward (every head); ~16 KB of bf16 in flight per program
EXPAND_ROWS = {"fwd": 64, "bwd": 32}


def _blocks(N: int, P: int, Vd: int) -> dict:
    return dict(BN=triton.next_power_of_2(N), BP=triton.next_power_of_2(P), BV=triton.next_power_of_2(Vd))


class _ExpandKeys(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, k_pe, nope_dim):
        *lead, H, width = kv.shape
        P = k_pe.shape[-1]
        N, Vd = nope_dim, width - nope_dim
        kv2 = kv.reshape(-1, H * width)
        if kv2.stride(-1) != 1:
            kv2 = kv2.contiguous()
        pe2 = k_pe.reshape(-1, P).to(kv.dtype)  # a small [R, P] cast, on the host side: the reference's rounding
        if pe2.stride(-1) != 1:
            pe2 = pe2.contiguous()
        R = kv2.shape[0]
        k = torch.empty(R, H, N + P, dtype=kv.dtype, device=kv.device)
        v = torch.empty(R, H, Vd, dtype=kv.dtype, device=kv.device)
        BLOCK_R = EXPAND_ROWS["fwd"]
        _expand_keys_fwd_kernel[(triton.cdiv(R, BLOCK_R), H)](
            kv2, pe2, k, v, R, kv2.stride(0), pe2.stride(0), H=H, N=N, P=P, VD=Vd, BLOCK_R=BLOCK_R,
            **_blocks(N, P, Vd))
        ctx.dims, ctx.lead, ctx.dtypes = (H, N, P, Vd), lead, (kv.dtype, k_pe.dtype)
        return k.view(*lead, H, N + P), v.view(*lead, H, Vd)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dk, dv):
        H, N, P, Vd = ctx.dims
        dk2 = dk.reshape(-1, H * (N + P)).contiguous()
        dv2 = dv.reshape(-1, H * Vd).contiguous()
        R = dk2.shape[0]
        kv_dtype, pe_dtype = ctx.dtypes
        dkv = torch.empty(R, H, N + Vd, dtype=kv_dtype, device=dk.device)
        dpe = torch.empty(R, P, dtype=torch.float32, device=dk.device)
        BLOCK_R = EXPAND_ROWS["bwd"]
        _expand_keys_bwd_kernel[(triton.cdiv(R, BLOCK_R),)](dk2, dv2, dkv, dpe, R, H=H, N=N, P=P, VD=Vd,
                                                           BLOCK_R=BLOCK_R, **_blocks(N, P, Vd))
        return dkv.view(*ctx.lead, H, N + Vd), dpe.to(pe_dtype).view(*ctx.lead, P), None


def expand_keys_available(kv: torch.Tensor) -> bool:
    """The Triton pair runs here: Triton on CUDA (or its interpreter), a float kv."""
    return triton is not None and kv.is_floating_point() and triton_runs_on(kv)


def expand_keys(kv: torch.Tensor, k_pe: torch.Tensor, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`naive_expand_keys` in one Triton pass each way. kv [..., H, N + Vd] (rows with unit element stride),
    k_pe [..., P] (a column slice of the latent is read in place). Returns k [..., H, N + P] in kv's dtype and
    v [..., H, Vd], both contiguous."""
    if kv.shape[:-2] != k_pe.shape[:-1]:
        raise ValueError(f"kv {tuple(kv.shape)} and k_pe {tuple(k_pe.shape)} must share their leading dims")
    if not 0 < nope_dim < kv.shape[-1]:
        raise ValueError(f"nope_dim {nope_dim} must split kv's last dim {kv.shape[-1]}")
    return _ExpandKeys.apply(kv, k_pe, nope_dim)
