"""Stable LatentMoE and the dense SiTU-GLU FFN (docs/architecture.md §5; K3 report §2.3).

Legend: N tokens, D model width, E experts, k experts per token, L latent width (D/2),
I expert hidden width.

Routing: sigmoid scores on the full-width input (fp32 logits); selection by top-k of scores + bias,
where the bias (`e_score_correction_bias`, set by Quantile Balancing) only selects; the weights are the
selected *unbiased* scores renormalised. Routed experts run in a shared latent space: one down-projection
D → L for all experts, SiTU-GLU experts L → I → L, weighted sum in fp32, RMSNorm (the "stable" part,
which removes the scale of the routed sum), one up-projection L → D. Shared experts run at full width.

Fast paths beside the references (config `moe_impl`, `situ_impl`, `router_impl`; "auto" = fast on CUDA):
- routed experts as grouped GEMMs with the MoE gradient transform (`k3.ops.moe.grouped_latent_experts`)
  instead of the padded-batch dispatch of `LatentExperts.forward_reference`; a decode step's few (token,
  expert) pairs (N·k ≤ E/2) gather their experts instead (`gathered_latent_experts`), reading no other expert;
  on the CPU ("auto") the padded dispatch in buckets of similar load (`LatentExperts.forward_bucketed`), and the
  gathered experts for a decode or verify step's few pairs;
- SiTU-GLU as fused Triton kernels (`k3.ops.situ.situ_glu`) instead of the autograd formula;
- routing (`router_impl`): the fp32 router logits from bf16 GEMMs on the weight split in three, the top-k and
  QB cutoff in one Triton kernel (`k3.ops.router`) instead of one fp32 GEMM and `torch.topk`.
The router GEMM stays separate from the latent down-projection: the router is computed in fp32 (with
autocast off), the down-projection in the activation dtype, so one fused GEMM would change one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3.config import ModelConfig
from k3.model.norm import RMSNorm
from k3.model.projections import fused_linears
from k3.model.quantile_balancing import route_topk_with_cutoff
from k3.ops.moe import gathered_latent_experts, grouped_latent_experts
from k3.ops.qat import (fake_quantize_input, fake_quantize_weight, qat_gathered_latent_experts,
                        qat_grouped_latent_experts)
from k3.ops.router import router_logits_reference, split_router_applies, split_router_logits
from k3.ops.situ import naive_situ_glu, situ_glu


def use_fast(impl: str, fast: str, x: torch.Tensor) -> bool:
    """One switch for every fast path: `impl` is the fast name, the reference, or "auto" (fast on CUDA)."""
    return impl == fast or (impl == "auto" and x.is_cuda)


class SiTUMLP(nn.Module):
    """down_proj(SiTU-GLU(gate_proj x, up_proj x)): the dense layer-0 FFN and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, beta1: float, beta2: float, impl: str = "auto",
                 activation: str = "situ"):
        super().__init__()
        self.beta1, self.beta2 = beta1, beta2
        self.impl = impl  # situ_impl
        self.activation = activation  # hidden_act: "situ", or "silu" (SwiGLU, the ablation baseline)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = situ_glu if use_fast(self.impl, "triton", x) else naive_situ_glu
        act = swiglu if self.activation == "silu" else act
        # gate and up as one GEMM; SiTU-GLU reads the two column slices in place
        gate, up = fused_linears(x, (self.gate_proj, self.up_proj), row_multiple=16)
        return self.down_proj(act(gate, up, self.beta1, self.beta2))


def swiglu(gate: torch.Tensor, up: torch.Tensor, beta1: float | None = None, beta2: float | None = None) -> torch.Tensor:
    """SwiGLU, silu(gate)·up: the GLU SiTU-GLU replaced (`hidden_act: silu`; docs/ablations.md). The betas are
    SiTU's and unused."""
    return torch.nn.functional.silu(gate) * up


class Router(nn.Module):
    """`gate.weight` [E, D] and the selection-only bias buffer `gate.e_score_correction_bias` [E] (fp32)."""

    def __init__(self, hidden_size: int, num_experts: int, impl: str = "auto"):
        super().__init__()
        self.impl = impl  # router_impl
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, D] -> sigmoid scores [N, E] in fp32 (autocast off: it would run the GEMM in bf16). A bf16 h (under
        autocast) and the fp32 weight give the fp32 logits from bf16 GEMMs on the split weight (k3.ops.router)."""
        split = self.fast(h) and split_router_applies(h, self.weight)
        logits = split_router_logits(h, self.weight) if split else router_logits_reference(h, self.weight)
        return torch.sigmoid(logits)

    def fast(self, x: torch.Tensor) -> bool:
        return use_fast(self.impl, "fast", x)


def pairs_by_expert(topk_idx: torch.Tensor, num_experts: int):
    """The N·k (token, expert) pairs of topk_idx [N, k] sorted by expert -> (order: sorted position -> pair,
    token_of [N·k], expert_of [N·k] non-decreasing, counts [E] pairs per expert, slot [N·k]: row within its expert)."""
    N, k = topk_idx.shape
    flat_expert = topk_idx.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    expert_of = flat_expert[order]
    counts = torch.bincount(flat_expert, minlength=num_experts)
    slot = torch.arange(N * k, device=topk_idx.device) - (counts.cumsum(0) - counts)[expert_of]
    return order, order // k, expert_of, counts, slot


def combine_pairs(out: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, token_of: torch.Tensor,
                  accum: torch.dtype) -> torch.Tensor:
    """Expert outputs out [N·k, L] in sorted-pair order -> their router-weighted sum per token [N, L] in `accum`."""
    weighted = out.to(accum) * weights.reshape(-1)[order].unsqueeze(-1).to(accum)
    return torch.zeros(weights.shape[0], out.shape[1], dtype=accum, device=out.device).index_add_(0, token_of, weighted)


class LatentExperts(nn.Module):
    """Routed experts stacked per kind: w1 (gate) and w3 (up) [E, I, L], w2 (down) [E, L, I].

    Under QAT every path (reference, grouped, gathered) runs its GEMMs on MXFP4 weights and MXFP8 inputs, with
    straight-through gradients (`k3.ops.qat`, docs/qat.md)."""

    def __init__(self, num_experts: int, latent_size: int, intermediate_size: int, beta1: float, beta2: float,
                 impl: str = "auto", activation: str = "situ", qat_scale_mode: str | None = None):
        super().__init__()
        self.beta1, self.beta2 = beta1, beta2
        self.impl = impl  # moe_impl: reference | grouped | auto
        # config `qat: mxfp4` (k3.ops.qat): MXFP4 weights and MXFP8 inputs in every path, this E8M0 scale rounding
        self.qat_scale_mode = qat_scale_mode  # None: no fake quantization
        self.glu = swiglu if activation == "silu" else naive_situ_glu  # hidden_act (SwiGLU: the reference only)
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, latent_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, latent_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, latent_size, intermediate_size))

    def expert(self, e: int, z: torch.Tensor) -> torch.Tensor:
        """Expert e on latent rows z [n, L] -> [n, L]."""
        w1, w3, w2 = (fake_quantize_weight(w[e], self.qat_scale_mode) for w in (self.w1, self.w3, self.w2))
        z = fake_quantize_input(z, self.qat_scale_mode)
        act = fake_quantize_input(self.glu(z @ w1.t(), z @ w3.t(), self.beta1, self.beta2), self.qat_scale_mode)
        return act @ w2.t()

    def forward(self, z: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """z [N, L]; topk_idx [N, k]; weights [N, k] fp32. Returns Σ_j weights_j · E_j(z) [N, L] in fp32.

        The grouped-GEMM path (`k3.ops.moe`, no host sync) or `forward_reference`, by `self.impl`.
        """
        # a decode or verify step's few pairs: read only the selected experts (the grouped GEMMs would run every
        # expert, the CPU's buckets a padded block per load)
        few = topk_idx.numel() * 2 <= self.w1.shape[0]
        on_cpu = self.impl == "auto" and not z.is_cuda
        if (use_fast(self.impl, "grouped", z) or (on_cpu and few)) and self.glu is naive_situ_glu:
            if self.qat_scale_mode is not None:
                experts = qat_gathered_latent_experts if few else qat_grouped_latent_experts
                return experts(z, topk_idx, weights, self.w1, self.w3, self.w2, self.beta1, self.beta2,
                               self.qat_scale_mode)
            experts = gathered_latent_experts if few else grouped_latent_experts
            return experts(z, topk_idx, weights, self.w1, self.w3, self.w2, self.beta1, self.beta2)
        if on_cpu:
            return self.forward_bucketed(z, topk_idx, weights)
        return self.forward_reference(z, topk_idx, weights)

    def forward_bucketed(self, z: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`forward_reference` with the experts in buckets of similar load, each bucket its own zero-padded block
        whose capacity is at most twice the load of its lightest expert. One block padded to the busiest expert
        multiplies the rows by the max/mean load, several times over on SFT and RL batches (chat-template tokens,
        repeated in every conversation, route alike). The CPU path (`moe_impl` auto): it reads the loads on the
        host. Same results as the reference (tested).
        """
        N = topk_idx.shape[0]
        E, _, L = self.w1.shape
        accum = torch.float64 if z.dtype == torch.float64 else torch.float32
        order, token_of, expert_of, counts, slot = pairs_by_expert(topk_idx, E)
        loads = counts.tolist()
        # experts by load, heaviest first; a bucket takes the next expert while its capacity ≤ 2 × that load
        buckets: list[list[int]] = []
        for e in sorted((e for e in range(E) if loads[e]), key=lambda e: -loads[e]):
            if not buckets or loads[buckets[-1][0]] > 2 * loads[e]:
                buckets.append([])
            buckets[-1].append(e)
        if not buckets:
            return torch.zeros(N, L, dtype=accum, device=z.device)
        bucket_of, position = [0] * E, [0] * E
        for b, experts in enumerate(buckets):
            for j, e in enumerate(experts):
                bucket_of[e], position[e] = b, j
        pair_bucket = torch.tensor(bucket_of, device=z.device)[expert_of]
        pair_position = torch.tensor(position, device=z.device)[expert_of]
        w1, w3, w2 = (fake_quantize_weight(w, self.qat_scale_mode) for w in (self.w1, self.w3, self.w2))
        rows = fake_quantize_input(z, self.qat_scale_mode)[token_of]  # [N·k, L] in expert order
        outs, pair_ids = [], []
        for b, experts in enumerate(buckets):
            pairs = torch.nonzero(pair_bucket == b).flatten()
            ex = torch.tensor(experts, device=z.device)
            at = (pair_position[pairs], slot[pairs])
            blocks = rows.new_zeros(len(experts), loads[experts[0]], L).index_put(at, rows[pairs])  # [e, cap, L]
            act = self.glu(blocks @ w1[ex].transpose(1, 2), blocks @ w3[ex].transpose(1, 2), self.beta1, self.beta2)
            outs.append((fake_quantize_input(act, self.qat_scale_mode) @ w2[ex].transpose(1, 2))[at])
            pair_ids.append(pairs)
        out = torch.cat(outs)[torch.argsort(torch.cat(pair_ids))]  # [N·k, L] in expert order
        return combine_pairs(out, weights, order, token_of, accum)

    def forward_reference(self, z: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Reference dispatch: sort the N·k (token, expert) pairs by expert into a zero-padded [E, capacity, L]
        block (capacity = the busiest expert's load) and run all experts as three batched matmuls. Padding
        rows are zero, so they produce zero and receive zero gradient. With Quantile Balancing the padding
        stays small; on CPUs this beats a per-expert loop of small matmuls by a wide margin.
        """
        E, _, L = self.w1.shape
        order, token_of, expert_of, counts, slot = pairs_by_expert(topk_idx, E)
        capacity = int(counts.max())
        w1, w3, w2 = (fake_quantize_weight(w, self.qat_scale_mode) for w in (self.w1, self.w3, self.w2))
        zq = fake_quantize_input(z, self.qat_scale_mode)
        blocks = z.new_zeros(E, capacity, L).index_put((expert_of, slot), zq[token_of])  # [E, cap, L]
        act = self.glu(blocks @ w1.transpose(1, 2), blocks @ w3.transpose(1, 2), self.beta1, self.beta2)  # [E, cap, I]
        out = (fake_quantize_input(act, self.qat_scale_mode) @ w2.transpose(1, 2))[expert_of, slot]  # [N·k, L]
        accum = torch.float64 if z.dtype == torch.float64 else torch.float32
        return combine_pairs(out, weights, order, token_of, accum)


@dataclass
class RouterInfo:
    """What a training step needs from one MoE layer (detached): for Quantile Balancing and load metrics."""

    scores: torch.Tensor  # [N, E] fp32 sigmoid scores
    cutoff: torch.Tensor  # [N] the (k+1)-th biased score of every token
    topk_idx: torch.Tensor  # [N, k]


class StableLatentMoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        D, L = config.hidden_size, config.routed_expert_hidden_size
        b1, b2 = config.activation_situ_beta, config.activation_situ_linear_beta
        self.top_k = config.num_experts_per_token
        self.renormalize = config.moe_renormalize
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = Router(D, config.num_experts, config.router_impl)
        self.routed_expert_down_proj = nn.Linear(D, L, bias=False)
        self.experts = LatentExperts(config.num_experts, L, config.moe_intermediate_size, b1, b2, config.moe_impl,
                                     config.hidden_act, config.qat_scale_mode if config.qat == "mxfp4" else None)
        # latent_moe_use_norm false: the LatentMoE without the "stable" norm (the ablation baseline)
        self.routed_expert_norm = RMSNorm(L, config.rms_norm_eps) if config.latent_moe_use_norm else None
        self.routed_expert_up_proj = nn.Linear(L, D, bias=False)
        self.shared_experts = SiTUMLP(D, config.num_shared_experts * config.moe_intermediate_size, b1, b2,
                                      config.situ_impl, config.hidden_act)
        # routing replay (RL, k3.posttrain.replay): expert ids [N, k] that replace the top-k of the next forwards'
        # N tokens, so training routes each token as the rollout did; a row of -1 routes as usual. None: off
        self.replay_topk: torch.Tensor | None = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [N, D] -> (scores [N, E], topk_idx [N, k], weights [N, k], cutoff [N])."""
        scores = self.gate(h)
        bias = self.gate.e_score_correction_bias.to(scores.dtype)
        topk_idx, cutoff = route_topk_with_cutoff(scores.detach(), bias, self.top_k, fused=self.gate.fast(h))
        if self.replay_topk is not None:
            if self.replay_topk.shape != topk_idx.shape:
                raise ValueError(f"replayed routes are {list(self.replay_topk.shape)}, the forward routes "
                                 f"{list(topk_idx.shape)} [tokens, k]")
            forced = self.replay_topk.to(topk_idx.device, torch.int64)
            topk_idx = torch.where(forced >= 0, forced, topk_idx)
        weights = scores.gather(1, topk_idx)  # unbiased: the bias only selects
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return scores, topk_idx, weights * self.routed_scaling_factor, cutoff

    def forward(self, h: torch.Tensor, router_infos: list[RouterInfo] | None = None) -> torch.Tensor:
        """h [B, T, D] -> [B, T, D]. Appends this layer's RouterInfo to `router_infos` when given."""
        shape = h.shape
        h = h.reshape(-1, shape[-1])  # [N, D]
        scores, topk_idx, weights, cutoff = self.route(h)
        if router_infos is not None:
            router_infos.append(RouterInfo(scores.detach(), cutoff.detach(), topk_idx))
        z = self.routed_expert_down_proj(h)  # [N, L]
        u = self.experts(z, topk_idx, weights)  # [N, L] fp32
        u = self.routed_expert_norm(u, out_dtype=h.dtype) if self.routed_expert_norm is not None else u.to(h.dtype)
        routed = self.routed_expert_up_proj(u)
        return (self.shared_experts(h) + routed).view(shape)
