"""Kimi Delta Attention layer (docs/architecture.md §2; K3 report §2.1.1, Kimi Linear arXiv 2510.26692).

Legend: B batch, T tokens, D model width, H heads, K = V head dim, P = H·K.

Per token: q/k/v projections → causal depthwise short conv (width 4) + SiLU → per-head L2 norm of q, k
→ β = σ(b_proj x) → low-rank decay logits z = f_b(f_a x) + dt_bias → the lower-bounded gate
g = g_min·σ(exp(A_h)·z) → delta-rule recurrence with channel-wise decay → per-head RMSNorm →
full-rank sigmoid output gate → o_proj. The recurrence itself lives in `k3.ops.kda`; the layer picks
the implementation with `config.kda_impl`.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from k3.config import ModelConfig
from k3.model.cache import KDAState, PagedKDAState
from k3.model.norm import RMSNorm
from k3.model.projections import fused_linears
from k3.model.sequence import SequenceLayout
from k3.ops import triton_runs_on
from k3.ops.kda import naive_chunk_kda, naive_kda_gate, naive_recurrent_kda, torch_chunk_kda
from k3.ops.short_conv import causal_conv1d, conv_decode_step, short_conv_silu, short_conv_silu_available


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(‖x‖² + eps) over the last dim, in fp32."""
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    # Parameters kept in fp32 whatever the model dtype (as in the release, docs/architecture.md §2.1).
    fp32_params = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "dt_bias", "A_log", "o_norm.weight")

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        lin = config.linear_attn_config
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = lin.num_heads, lin.head_dim
        self.conv_size = lin.short_conv_kernel_size
        self.gate_lower_bound = lin.gate_lower_bound
        self.gate = config.kda_gate  # "lower_bounded" (K3), or "unbounded" (the ablation baseline)
        self.impl = config.kda_impl
        self.chunk_size = config.kda_chunk_size
        self.save_intermediates = config.kda_save_intermediates
        D, H, K = config.hidden_size, self.num_heads, self.head_dim
        P = H * K
        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, self.conv_size, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, self.conv_size, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, self.conv_size, groups=P, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        # decay logits are low-rank with rank = head_dim (docs/architecture.md §2.1)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.o_norm = RMSNorm(K, config.rms_norm_eps)
        self.g_proj = nn.Linear(D, P, bias=False)
        self.o_proj = nn.Linear(P, D, bias=False)

    @torch.no_grad()
    def reset_special_parameters(self, generator: torch.Generator) -> None:
        """A_log = 0 and Mamba-2-style dt_bias = softplus⁻¹(dt), dt ~ logU(1e-3, 1e-1) (docs/architecture.md §2.3)."""
        self.A_log.zero_()
        u = torch.rand(self.dt_bias.shape, generator=generator, device=self.dt_bias.device, dtype=torch.float32)
        dt = torch.exp(u * (torch.log(torch.tensor(1e-1)) - torch.log(torch.tensor(1e-3))) + torch.log(torch.tensor(1e-3)))
        dt = dt.clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def short_conv(self, pre: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv before SiLU: pre [B, T, P] -> (y [B, T, P], last W-1 inputs per sequence).

        A seam: context parallelism (k3.parallel) overrides it to bring in the previous rank's halo.
        """
        return causal_conv1d(pre, weight, conv_state, cu_seqlens)

    def fuses_short_conv(self, pre: torch.Tensor) -> bool:
        """Whether conv + SiLU runs as the fused kernel (`short_conv_silu`): with the KDA kernels, and only
        where the `short_conv` seam is not overridden (context parallelism brings its halo through it)."""
        return (self.impl == "triton" and short_conv_silu_available(pre)
                and type(self).short_conv is KimiDeltaAttention.short_conv)

    def gate_inputs(self, q: torch.Tensor, k: torch.Tensor, z: torch.Tensor, beta_logits: torch.Tensor):
        """Raw → recurrence inputs: L2-normed q, k; g = g_min·σ(exp(A)(z + dt_bias)) (fp32); β = σ(·) (fp32)."""
        g = naive_kda_gate(z, self.A_log, self.dt_bias, self.gate_lower_bound)  # fp32, in (g_min, 0)
        if self.gate == "unbounded":  # Kimi Linear / GDN's gate, -exp(A)·softplus(z + dt_bias), in (-inf, 0)
            x = z.to(g.dtype) + self.dt_bias.to(g.dtype).view(z.shape[-2:])
            g = -self.A_log.to(g.dtype).exp().view(-1, 1) * torch.nn.functional.softplus(x)
        beta = torch.sigmoid(beta_logits if beta_logits.dtype == torch.float64 else beta_logits.float())
        return l2_normalize(q), l2_normalize(k), g, beta

    def recurrence(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor,
                   beta_logits: torch.Tensor, initial_state: torch.Tensor | None, output_final_state: bool,
                   cu_seqlens: torch.Tensor | None, cu_seqlens_host: tuple[int, ...] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The delta-rule recurrence on raw inputs (q, k after conv+SiLU, not normalised; z before dt_bias;
        β logits), so fused kernels can take the gate, L2 norm and β sigmoid in. A seam: context
        parallelism overrides it. `cu_seqlens_host`: the same offsets as host ints, if known (the fused
        kernels then plan without reading `cu_seqlens` back). Returns (o [B, T, H, V], final state
        [N, H, K, V] or None).
        """
        if self.impl == "triton":
            return self.triton_recurrence(q, k, v, z, beta_logits, initial_state, output_final_state, cu_seqlens,
                                          cu_seqlens_host)
        q, k, g, beta = self.gate_inputs(q, k, z, beta_logits)
        kw = dict(initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        if self.impl == "recurrent" or q.shape[1] == 1:
            return naive_recurrent_kda(q, k, v, g, beta, **kw)
        if self.impl == "torch":
            return torch_chunk_kda(q, k, v, g, beta, **kw, chunk_size=self.chunk_size,
                                   gate_lower_bound=self.gate_lower_bound)
        if self.impl == "naive":
            return naive_chunk_kda(q, k, v, g, beta, **kw, chunk_size=self.chunk_size)
        raise ValueError(f"kda_impl {self.impl!r} is not available in this build")

    def triton_recurrence(self, q, k, v, z, beta_logits, initial_state, output_final_state, cu_seqlens,
                          cu_seqlens_host=None):
        """`kda_impl == "triton"`: the fused kernels on CUDA (or in the Triton interpreter), else the torch path.

        A few tokens per sequence without autograd (decode, speculative verify) take `fused_recurrent_kda` on
        a copy of the state; everything else takes the differentiable `chunk_kda`. On CPU without
        TRITON_INTERPRET=1 the torch reference runs instead, so a GPU config also loads on a CPU machine.
        """
        if not triton_runs_on(q):
            q, k, g, beta = self.gate_inputs(q, k, z, beta_logits)
            kw = dict(initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
            if q.shape[1] == 1:
                return naive_recurrent_kda(q, k, v, g, beta, **kw)
            chunk = max(1, min(16, int(80 // abs(self.gate_lower_bound))))
            return torch_chunk_kda(q, k, v, g, beta, **kw, chunk_size=chunk, gate_lower_bound=self.gate_lower_bound)
        from k3.ops.kda import chunk_kda, fused_recurrent_kda

        B, T, H, K = q.shape
        if cu_seqlens is None and T <= 4 and not torch.is_grad_enabled():
            state = (q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32) if initial_state is None
                     else initial_state.to(torch.float32, copy=True).contiguous())
            o, _ = fused_recurrent_kda(q, k, v, z, beta_logits, self.A_log, self.dt_bias, state,
                                       gate_lower_bound=self.gate_lower_bound)
            return o, (state if output_final_state else None)
        return chunk_kda(q, k, v, z, beta_logits, self.A_log, self.dt_bias, gate_lower_bound=self.gate_lower_bound,
                         initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                         cu_seqlens_host=cu_seqlens_host, save_intermediates=self.save_intermediates)

    def input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The six projections of x [B, T, D] — q, k, v, output gate (each [B, T, P]), β logits [B, T, H] and
        the decay's low-rank input [B, T, K] — as one GEMM (`fused_linears`). Its output rows are padded to a
        multiple of 16 elements: the short conv, the gated norm and the KDA kernels read these slices in place,
        as 16-byte vectors only on aligned rows."""
        return fused_linears(x, (self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.b_proj, self.f_a_proj),
                             row_multiple=16)

    def forward(self, x: torch.Tensor, layout: SequenceLayout, state: KDAState | None = None,
                use_cache: bool = False) -> tuple[torch.Tensor, KDAState | None]:
        """x [B, T, D] (already input_layernorm'ed). Returns (y [B, T, D], new state or None)."""
        if isinstance(state, PagedKDAState):
            return self.paged_decode(x, state), state
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        cu = layout.cu_seqlens

        q_pre, k_pre, v_pre, g_pre, beta_logits, f_a = self.input_projections(x)

        def conv_path(pre: torch.Tensor, conv: nn.Conv1d, conv_state):
            if conv_state is None and not use_cache and self.fuses_short_conv(pre):
                if cu is not None:
                    return short_conv_silu(pre.view(1, B * T, -1), conv.weight, cu).view(B, T, -1), None
                return short_conv_silu(pre, conv.weight), None
            if cu is not None:
                # packed documents; with a cache each document continues its own sequence's history
                y, tail = self.short_conv(pre.view(1, B * T, -1), conv.weight, conv_state, cu)
                y = y.view(B, T, -1)
            else:
                y, tail = self.short_conv(pre, conv.weight, conv_state, None)
            return F.silu(y), tail

        q, tail_q = conv_path(q_pre, self.q_conv1d, state.conv_q if state else None)
        k, tail_k = conv_path(k_pre, self.k_conv1d, state.conv_k if state else None)
        v, tail_v = conv_path(v_pre, self.v_conv1d, state.conv_v if state else None)
        q, k, v = (t.view(B, T, H, K) for t in (q, k, v))  # [B, T, H, K]
        z = self.f_b_proj(f_a).view(B, T, H, K)  # [B, T, H, K] decay logits before dt_bias

        initial = state.recurrent if state is not None else None
        if layout.one_token_per_document():
            # every document is one token (a batched decode step): a dense batch of one-step recurrences
            q, k, v, z, beta_logits = (t.reshape(B * T, 1, *t.shape[2:]) for t in (q, k, v, z, beta_logits))
            cu = None
        elif cu is not None:
            q, k, v, z, beta_logits = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, z, beta_logits))
        o, final = self.recurrence(q, k, v, z, beta_logits, initial, use_cache, cu,
                                   layout.offsets if cu is layout.cu_seqlens else None)
        o = o.view(B, T, H, K)

        # per-head norm (gain shared by heads) and the sigmoid output gate: one fused kernel each way on CUDA
        o = self.o_norm.gated(o, g_pre.view(B, T, H, K))  # in the gate's dtype (the projections')
        y = self.o_proj(o.reshape(B, T, H * K))
        new_state = KDAState(tail_q, tail_k, tail_v, final) if use_cache else None
        return y, new_state

    def paged_decode(self, x: torch.Tensor, state: PagedKDAState) -> torch.Tensor:
        """One token per row (x [B, 1, D]) against states kept in place in a slot pool: the engine's decode step.

        Same math as `forward` with a `KDAState` (the conv tails and the recurrence advance by one token), with
        no copy of the states in or out and no host sync: on CUDA (or in the interpreter) the fused decode
        kernel updates the slots in place; elsewhere the states are gathered, advanced and written back.
        """
        B = x.shape[0]
        H, K = self.num_heads, self.head_dim
        slots = state.slots
        q_pre, k_pre, v_pre, g_pre, beta_logits, f_a = self.input_projections(x)
        pre = torch.stack([q_pre[:, 0], k_pre[:, 0], v_pre[:, 0]], dim=1)  # [B, 3, P]
        weights = torch.stack([self.q_conv1d.weight[:, 0], self.k_conv1d.weight[:, 0], self.v_conv1d.weight[:, 0]])
        y, tails = conv_decode_step(pre, weights, state.conv[slots])
        state.conv[slots] = tails.to(state.conv.dtype)
        q, k, v = F.silu(y).transpose(0, 1).contiguous().view(3, B, 1, H, K)  # each contiguous, as the kernel reads
        z = self.f_b_proj(f_a).view(B, 1, H, K)
        beta_logits = beta_logits.reshape(B, 1, H)
        if self.impl == "triton" and triton_runs_on(q):
            from k3.ops.kda import fused_recurrent_kda

            o, _ = fused_recurrent_kda(q, k, v, z, beta_logits, self.A_log, self.dt_bias, state.recurrent, slots,
                                       gate_lower_bound=self.gate_lower_bound)
        else:
            o, final = self.recurrence(q, k, v, z, beta_logits, state.recurrent[slots], True, None)
            state.recurrent[slots] = final.to(state.recurrent.dtype)
        o = self.o_norm.gated(o.view(B, 1, H, K), g_pre.view(B, 1, H, K))
        return self.o_proj(o.reshape(B, 1, H * K))
