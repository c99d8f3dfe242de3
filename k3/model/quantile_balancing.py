"""Quantile Balancing (QB): the auxiliary-loss-free router bias update of K3.

Follows the K3 report §2.3.3, App. C (exact rule, Algorithm 1) and App. D (distributed
histogram estimator); the rule: docs/architecture.md §5.1 and §6; k3's choices and the estimator's error
bound: docs/quantile-balancing.md.

The router selects top-k of s + b; b only selects, never weights. Each step, every token's
cutoff α_i (the (k+1)-th largest biased score) turns expert j's admission into a threshold on b_j:
token i picks j iff b_j > r_ij = α_i − s_ij. Setting b_j to the k/E-quantile of r_{:,j} gives every
expert exactly q = m·k/E tokens under those cutoffs. The new b is used from the next step on.

Two estimators of that quantile:
- `qb_exact`: one process, sort-based (order statistics), the reference.
- `QuantileHistogram`: what K3 runs; integer bin counts per expert, summed over micro-batches
  and over ranks by one all-reduce, so the result is the pooled-batch quantile within one bin width.

Everything here is pure: functions return the new bias; the caller writes it into the
`e_score_correction_bias` buffer. Nothing here carries gradients.

Legend: N routed tokens, E experts, B histogram bins, k experts per token.
"""

import torch
from torch import Tensor

from k3.ops.router import qb_histogram_add_triton, routing_kernels_apply, topk_with_cutoff_triton


def _check_scores(scores: Tensor, cutoff: Tensor | None = None, token_mask: Tensor | None = None) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores must be [N, E], got shape {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be floating point, got {scores.dtype}")
    n = scores.shape[0]
    if cutoff is not None and tuple(cutoff.shape) != (n,):
        raise ValueError(f"cutoff must be [N] = [{n}], got shape {tuple(cutoff.shape)}")
    if token_mask is not None:
        if tuple(token_mask.shape) != (n,):
            raise ValueError(f"token_mask must be [N] = [{n}], got shape {tuple(token_mask.shape)}")
        if token_mask.dtype != torch.bool:
            raise ValueError(f"token_mask must be bool, got {token_mask.dtype}")


def _check_top_k(top_k: int, num_experts: int) -> None:
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    # top-(k+1) needs a (k+1)-th expert for the cutoff
    if num_experts <= top_k:
        raise ValueError(f"QB needs more experts than top_k (E={num_experts}, k={top_k})")


def route_topk_with_cutoff(scores: Tensor, bias: Tensor, top_k: int, fused: bool = False) -> tuple[Tensor, Tensor]:
    """Route each token to the top-k of s + b and return its cutoff α (the (k+1)-th biased value).

    scores [N, E] fp32 sigmoid router scores; bias [E] fp32.
    Returns topk_idx [N, k] int64 (descending biased score) and cutoff [N] (detached, dtype of s + b).
    `fused`: one Triton kernel where it runs (k3.ops.router; exact ties go to the lower expert index), else
    torch.topk.
    """
    _check_scores(scores)
    if tuple(bias.shape) != (scores.shape[1],):
        raise ValueError(f"bias must be [E] = [{scores.shape[1]}], got shape {tuple(bias.shape)}")
    _check_top_k(top_k, scores.shape[1])
    if fused and routing_kernels_apply(scores) and bias.dtype == torch.float32:
        return topk_with_cutoff_triton(scores.detach(), bias, top_k)
    vals, idx = torch.topk(scores + bias, top_k + 1, dim=-1)  # [N, k+1]
    # the cutoff only feeds the balancer; it must not carry the router's graph
    return idx[:, :top_k], vals[:, top_k].detach()


def required_bias(scores: Tensor, cutoff: Tensor) -> Tensor:
    """r [N, E] = α_i − s_ij: the bias expert j needs to enter token i's top-k (it enters iff b_j > r_ij)."""
    _check_scores(scores, cutoff)
    return cutoff[:, None] - scores


def expert_loads(topk_idx: Tensor, num_experts: int, token_mask: Tensor | None = None) -> Tensor:
    """Tokens per expert: topk_idx [N, k] int64, optional token_mask [N] bool -> loads [E] int64."""
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [N, k], got shape {tuple(topk_idx.shape)}")
    if token_mask is not None:
        if tuple(token_mask.shape) != (topk_idx.shape[0],) or token_mask.dtype != torch.bool:
            raise ValueError("token_mask must be a bool tensor of shape [N]")
        topk_idx = topk_idx[token_mask]
    return count_ids(topk_idx.reshape(-1), num_experts)


def count_ids(ids: Tensor, n: int) -> Tensor:
    """Occurrences of each id in [0, n): [n] int64. Unlike `torch.bincount`, whose CUDA kernel reads the
    largest id back to the host, a scatter-add into a fixed-size tensor keeps the GPU queue running."""
    ones = torch.ones_like(ids, dtype=torch.int64)
    return torch.zeros(n, dtype=torch.int64, device=ids.device).index_add_(0, ids, ones)


def qb_exact(
    scores: Tensor, cutoff: Tensor, top_k: int, token_mask: Tensor | None = None, center: bool = True
) -> Tensor:
    """Exact QB update on one process (App. C, Algorithm 1): the reference for the histogram.

    scores [N, E] fp32, cutoff [N] (from `route_topk_with_cutoff` with the current bias),
    token_mask [N] bool (False = padding). Returns the new bias [E] fp32.

    b_j is the (⌊q⌋+1)-th smallest r_ij over the m unmasked tokens, i.e. minus the (⌊q⌋+1)-th
    largest margin s_ij − α_i, with q = m·k/E. Under fixed cutoffs expert j then gets
    #{r < b_j} ≤ q < #{r ≤ b_j}: exactly q when q is an integer and there are no ties.
    For non-integer q this is ⌊q⌋ (the floor is the rounding). Since k < E, ⌊q⌋ ≤ m − 1 always.
    """
    _check_scores(scores, cutoff, token_mask)
    num_experts = scores.shape[1]
    _check_top_k(top_k, num_experts)
    scores, cutoff = scores.detach(), cutoff.detach()
    if token_mask is not None:
        scores, cutoff = scores[token_mask], cutoff[token_mask]
    m = scores.shape[0]
    if m == 0:
        raise ValueError("qb_exact needs at least one unmasked token")
    q_floor = (m * top_k) // num_experts
    r = required_bias(scores, cutoff)  # [m, E]
    # the (⌊q⌋+1)-th smallest of each column; kthvalue is 1-based
    bias = torch.kthvalue(r, q_floor + 1, dim=0).values.float()  # [E]
    return bias - bias.mean() if center else bias


class QuantileHistogram:
    """Distributed QB estimator (App. D): per-expert histograms of r, summed over micro-batches and ranks.

    Build one per MoE layer per step from the bias that routed that step; `add` every micro-batch;
    all-reduce (SUM) `state_tensors()` over the ranks holding distinct tokens (DP × CP, never TP/EP
    replicas); then `bias(top_k)` gives the next step's bias.

    Bin range [lo, hi] = [min b − 1, max b + 1] holds every r (s ∈ (0, 1), α ∈ s + b); it depends only
    on the replicated bias, so all ranks bin identically. Each token lands in exactly one bin per
    expert, so every row of `counts` sums to the token count m: the counts alone are the whole state,
    and one integer all-reduce suffices.
    """

    def __init__(self, bias: Tensor, num_bins: int = 1000, fused: bool = False):
        """`fused`: `add` counts in one Triton kernel where Triton runs (k3.ops.router), else in torch."""
        self.fused = fused
        if bias.dim() != 1:
            raise ValueError(f"bias must be [E], got shape {tuple(bias.shape)}")
        if num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {num_bins}")
        bias = bias.detach().float()
        self.num_experts = bias.shape[0]
        self.num_bins = num_bins
        # 0-dim tensors on the bias's device: no host sync while accumulating
        self.lo = bias.min() - 1.0
        self.hi = bias.max() + 1.0
        self._width = (self.hi - self.lo) / num_bins
        self.counts = torch.zeros(self.num_experts, num_bins, dtype=torch.int64, device=bias.device)  # [E, B]

    @property
    def bin_width(self) -> float:
        return float(self._width)

    @property
    def num_tokens(self) -> int:
        """Tokens counted so far (after the all-reduce: the global m)."""
        return int(self.counts[0].sum())

    def add(self, scores: Tensor, cutoff: Tensor, token_mask: Tensor | None = None) -> None:
        """Count one micro-batch: scores [N, E], cutoff [N], token_mask [N] bool (False = padding)."""
        _check_scores(scores, cutoff, token_mask)
        if scores.shape[1] != self.num_experts:
            raise ValueError(f"scores have {scores.shape[1]} experts, histogram has {self.num_experts}")
        scores, cutoff = scores.detach(), cutoff.detach()
        if token_mask is not None:
            scores, cutoff = scores[token_mask], cutoff[token_mask]
        if self.fused and routing_kernels_apply(scores):  # the same bins from one kernel (k3.ops.router)
            qb_histogram_add_triton(self.counts, scores, cutoff, self.lo, self._width)
            return
        r = required_bias(scores, cutoff).float()  # [N, E]
        # NaN (a broken step, which the loop then skips) into bin 0, never out of range: as the fused kernel does
        bins = ((r - self.lo) / self._width).floor().nan_to_num(0.0).clamp(0, self.num_bins - 1).long()  # [N, E]
        # flatten (expert, bin) so one bincount fills the whole [E, B] matrix
        offsets = torch.arange(self.num_experts, device=bins.device) * self.num_bins
        flat = (bins + offsets).reshape(-1)
        self.counts += count_ids(flat, self.num_experts * self.num_bins).view_as(self.counts)

    def state_tensors(self) -> tuple[Tensor, ...]:
        """The tensors to all-reduce (SUM, in place) before `bias`: just `counts` [E, B] int64.

        The token count is not sent separately: every row of the summed counts adds up to the
        global m, so it cannot drift out of sync with them.
        """
        return (self.counts,)

    def bias(self, top_k: int, center: bool = True, num_tokens: int | None = None) -> Tensor:
        """New bias [E] fp32 from the (all-reduced) counts: the k/E-quantile of r per expert (App. D, step 4).

        q = m·k/E; ℓ_j is the first bin whose cumulative count reaches ⌈q⌉, c_j the count before it,
        h_j the count inside it; b_j = lo + (ℓ_j + clip((q − c_j)/h_j, 0, 1))·w. Non-integer q is
        used as is: the fractional part interpolates inside the bin.
        """
        _check_top_k(top_k, self.num_experts)
        # num_tokens: the count already read back by the caller (train_step reads it with its other numbers, so
        # that the bias update after the optimizer step does not wait for the GPU)
        m = self.num_tokens if num_tokens is None else int(num_tokens)
        if m == 0:
            raise ValueError("QuantileHistogram.bias needs at least one counted token")
        q = m * top_k / self.num_experts
        q_ceil = -((-m * top_k) // self.num_experts)
        cum = self.counts.cumsum(dim=1)  # [E, B]
        target = torch.full((self.num_experts, 1), q_ceil, dtype=cum.dtype, device=cum.device)
        # rows are non-decreasing and end at m ≥ ⌈q⌉, so the bin always exists
        ell = torch.searchsorted(cum, target).squeeze(1)  # [E]
        inside = self.counts.gather(1, ell[:, None]).squeeze(1)  # [E]
        before = cum.gather(1, ell[:, None]).squeeze(1) - inside  # [E]
        frac = ((q - before.double()) / inside.double()).clamp(0.0, 1.0)
        bias = (self.lo.double() + (ell.double() + frac) * self._width.double()).float()
        return bias - bias.mean() if center else bias


def imbalance_metrics(loads: Tensor) -> dict[str, float]:
    """Load imbalance of loads [E]: max/mean and MaxVio = (max − mean)/mean."""
    if loads.dim() != 1 or loads.numel() == 0:
        raise ValueError(f"loads must be a non-empty [E] tensor, got shape {tuple(loads.shape)}")
    per_layer = imbalance_from_stats(*layer_load_stats(loads[None]).tolist())
    return {name: values[0] for name, values in per_layer.items()}


def layer_load_stats(loads: Tensor) -> Tensor:
    """[2, L] float64 on loads' device: each layer's mean and max load, for `imbalance_from_stats` (a training
    step reads them back together with its other numbers: one wait for the GPU per step)."""
    if loads.dim() != 2 or loads.numel() == 0:
        raise ValueError(f"loads must be a non-empty [L, E] tensor, got shape {tuple(loads.shape)}")
    loads = loads.double()
    return torch.stack([loads.mean(dim=1), loads.amax(dim=1)])


def imbalance_from_stats(means: list[float], maxes: list[float]) -> dict[str, list[float]]:
    """max/mean and MaxVio = (max − mean)/mean per layer, from `layer_load_stats` read back."""
    if any(mean <= 0 for mean in means):
        raise ValueError("loads are all zero")
    ratios = [mx / mean for mx, mean in zip(maxes, means)]
    return {"max_over_mean": ratios, "max_vio": [r - 1.0 for r in ratios]}
