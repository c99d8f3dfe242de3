"""The MoE router's fp32 logits from bf16 tensor-core GEMMs: the fp32 weight split into three bf16 parts.

Legend: N tokens, D model width, E experts.

The router runs in fp32 (`k3.model.moe.Router`): logits = h W^T with W [E, D] the fp32 master weight. Its input
h is the bf16 activation under autocast, so h is exact in bf16, and W splits exactly into three bf16 parts
(fp32 keeps 24 significant bits, each round-to-nearest bf16 part takes at least 8 of them):

    W = W0 + W1 + W2,   W0 = bf16(W),  W1 = bf16(W − W0),  W2 = W − W0 − W1   (exact)

so h W^T = h W0^T + h W1^T + h W2^T with every product exact, from one bf16 GEMM against [W0; W1; W2] ([3E, D])
with fp32 output. The sums are the tensor cores' fp32 accumulation, which on the H200 is not the CUDA cores'
(it aligns and truncates within each MMA): relative error 7e-7 to 8e-6 against fp64 at the small and K3 router
shapes, where the CUDA-core fp32 GEMM gives 5-6e-7 and bf16 weights ~2e-3 (tests/gpu/test_fast_paths.py). The
fp32 GEMMs (no TF32: it would round W to 10 bits) ran on the CUDA cores, slower than the split
(docs/fast-paths.md).
`router_impl="reference"` keeps the CUDA-core fp32 GEMM.

Backward, with G = dL/dlogits [N, E] fp32 split the same way (G = G0 + G1 + G2, exact):
- dW = G^T h = Σ_j G_j^T h: one bf16 GEMM [3E, N] x [N, D], then the three [E, D] blocks summed (exact
  products, tensor-core sums as in the forward: 4-5e-6 against fp64 on the H200);
- dh = G W: returned in h's dtype (bf16), so terms below 2^-16 of the largest (G1 W1, G2 W0, G0 W2, ...) cannot
  show: G0 W0 + G1 W0 + G0 W1 as one GEMM [G0 | G1 | G0] x [W0; W0; W1] with K = 3E.
`router_logits_reference` is one fp32 GEMM; elsewhere than CUDA the bf16 GEMMs run as fp32 GEMMs on the bf16
values (the same exact products, IEEE fp32 sums), so the split's algebra is tested on CPU at fp32 accuracy.

Selection (`topk_with_cutoff_triton`): the top-k of s + b per token and the (k+1)-th value (Quantile Balancing's
cutoff), one Triton program per block of rows with the whole row of E biased scores in registers: k + 1 rounds
of (max, lowest index attaining it, mask it out), where `torch.topk` over [N, E] with E = 64 runs far below the
bandwidth its bytes need. Same values as torch.topk; among exactly equal
values the lower expert index comes first (torch.topk leaves that order unspecified); NaN ranks highest, as
in torch.topk, so every index is a valid expert (a NaN cutoff comes back as +inf; such a step is skipped).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops import triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch.topk
    triton = None


def router_logits_reference(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [N, D], weight [E, D] -> logits [N, E] in fp32 (fp64 for fp64 inputs), autocast off."""
    compute = torch.float64 if h.dtype == torch.float64 else torch.float32
    with torch.autocast(h.device.type, enabled=False):
        return F.linear(h.to(compute), weight.to(compute))


def split_router_applies(h: torch.Tensor, weight: torch.Tensor) -> bool:
    """The split reproduces the fp32 products exactly only for bf16 inputs and an fp32 weight."""
    return h.dtype == torch.bfloat16 and weight.dtype == torch.float32


def split_router_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as `router_logits_reference` for bf16 h and fp32 weight: logits [N, E] fp32."""
    if not split_router_applies(h, weight):
        raise ValueError(f"the split router takes bf16 inputs and an fp32 weight, got {h.dtype} and {weight.dtype}")
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"h [N, D] and weight [E, D] expected, got {tuple(h.shape)} and {tuple(weight.shape)}")
    with torch.autocast(h.device.type, enabled=False):
        return _SplitRouterLogits.apply(h, weight)


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 x -> three bf16 tensors whose fp32 sum is exactly x where |x| ≥ 2^-110 (below, the last part is a
    subnormal and the error under 2^-133)."""
    x0 = x.to(torch.bfloat16)
    rest = x - x0.float()
    x1 = rest.to(torch.bfloat16)
    return x0, x1, (rest - x1.float()).to(torch.bfloat16)


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a @ b for bf16 operands, accumulated in fp32 and returned in `dtype` (rounded once): cuBLAS on CUDA;
    elsewhere an fp32 GEMM on the bf16 values (exact products, IEEE fp32 sums)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32) if dtype == torch.float32 else (a @ b).to(dtype)
    return (a.float() @ b.float()).to(dtype)


class _SplitRouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight):
        E = weight.shape[0]
        y = _mm(h, torch.cat(split_bf16(weight)).t())  # [N, 3E]
        ctx.save_for_backward(h, weight)
        return (y[:, 2 * E:] + y[:, E:2 * E]) + y[:, :E]  # the small parts first

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        E = weight.shape[0]
        g0, g1, g2 = split_bf16(grad.float().contiguous())
        dh = dw = None
        if ctx.needs_input_grad[0]:
            w0, w1, _ = split_bf16(weight)
            dh = _mm(torch.cat([g0, g1, g0], dim=1), torch.cat([w0, w0, w1]), h.dtype)
        if ctx.needs_input_grad[1]:
            parts = _mm(torch.cat([g0, g1, g2], dim=1).t(), h)  # [3E, D]
            dw = (parts[2 * E:] + parts[E:2 * E]) + parts[:E]
        return dh, dw


if triton is not None:

    @triton.jit
    def _topk_cutoff_kernel(S, BIAS, IDX, CUT, N, E, K: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_E: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_E)
        rmask = rows < N
        cmask = cols < E
        s = tl.load(S + rows[:, None].to(tl.int64) * E + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0)
        s = s + tl.load(BIAS + cols, mask=cmask, other=0.0)[None, :]
        s = tl.where(s != s, float("inf"), s)  # NaN ranks highest, as in torch.topk
        s = tl.where(cmask[None, :], s, float("-inf"))
        for j in tl.static_range(K + 1):
            best = tl.max(s, axis=1)
            pick = tl.min(tl.where(s == best[:, None], cols[None, :], BLOCK_E), axis=1)
            if j < K:
                tl.store(IDX + rows.to(tl.int64) * K + j, pick.to(tl.int64), mask=rmask)
                s = tl.where(cols[None, :] == pick[:, None], float("-inf"), s)
            else:
                tl.store(CUT + rows, best, mask=rmask)


def topk_with_cutoff_triton(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [N, E] fp32, bias [E] fp32 -> (top-k expert ids of scores + bias [N, k] int64 by descending value,
    the (k+1)-th value [N] fp32). Needs k < E (checked by the caller) and E ≤ 4096."""
    N, E = scores.shape
    if E > 4096:
        raise ValueError(f"the top-k kernel holds a row of at most 4096 experts, got {E}")
    scores, bias = scores.float().contiguous(), bias.float().contiguous()
    idx = torch.empty(N, k, dtype=torch.int64, device=scores.device)
    cutoff = torch.empty(N, dtype=torch.float32, device=scores.device)
    BLOCK_E = triton.next_power_of_2(E)
    BLOCK_N = max(1, min(64, 2048 // BLOCK_E))
    _topk_cutoff_kernel[(triton.cdiv(N, BLOCK_N),)](scores, bias, idx, cutoff, N, E, K=k, BLOCK_N=BLOCK_N,
                                                    BLOCK_E=BLOCK_E, num_warps=4)
    return idx, cutoff


def routing_kernels_apply(scores: torch.Tensor) -> bool:
    """The top-k and QB-histogram kernels take these scores: fp32 rows of at most 4096 experts, where Triton runs."""
    return (triton is not None and triton_runs_on(scores) and scores.dtype == torch.float32
            and scores.shape[-1] <= 4096)


if triton is not None:

    @triton.jit
    def _qb_histogram_kernel(S, CUT, LO, WIDTH, COUNTS, N, E, NUM_BINS, BLOCK_N: tl.constexpr,
                             BLOCK_E: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_E)
        mask = (rows < N)[:, None] & (cols < E)[None, :]
        s = tl.load(S + rows[:, None].to(tl.int64) * E + cols[None, :], mask=mask, other=0.0)
        cut = tl.load(CUT + rows, mask=rows < N, other=0.0)
        lo, width = tl.load(LO), tl.load(WIDTH)
        # the reference's fp32 ops, each correctly rounded: r = α − s, then (r − lo) / width
        t = tl.math.div_rn((cut[:, None] - s) - lo, width)
        t = tl.where(t == t, tl.floor(t), 0.0)  # NaN (a broken step) into bin 0, never out of range
        b = tl.minimum(tl.maximum(t, 0.0), NUM_BINS - 1).to(tl.int64)
        tl.atomic_add(COUNTS + cols[None, :].to(tl.int64) * NUM_BINS + b, tl.full(b.shape, 1, tl.int64),
                      mask=mask, sem="relaxed")


def qb_histogram_add_triton(counts: torch.Tensor, scores: torch.Tensor, cutoff: torch.Tensor, lo: torch.Tensor,
                            width: torch.Tensor) -> None:
    """counts [E, B] int64 += the histogram of r = cutoff − scores per expert over B bins of `width` from `lo`
    (0-dim fp32 device tensors; bins clamped to [0, B−1]): Quantile Balancing's `QuantileHistogram.add` in one
    kernel, the same fp32 arithmetic, instead of about ten [N, E] passes and an index_add_ of N·E int64 ones."""
    N, E = scores.shape
    B = counts.shape[1]
    if counts.dtype != torch.int64 or tuple(counts.shape) != (E, B) or not counts.is_contiguous():
        raise ValueError(f"counts must be a contiguous [E, B] = [{E}, B] int64 tensor, got {tuple(counts.shape)} "
                         f"{counts.dtype}")
    scores, cutoff = scores.float().contiguous(), cutoff.float().contiguous()
    BLOCK_E = triton.next_power_of_2(E)
    BLOCK_N = max(1, min(64, 4096 // BLOCK_E))
    _qb_histogram_kernel[(triton.cdiv(N, BLOCK_N),)](scores, cutoff, lo.float().reshape(1), width.float().reshape(1),
                                                     counts, N, E, B, BLOCK_N=BLOCK_N, BLOCK_E=BLOCK_E, num_warps=4)
