"""Routed experts as grouped GEMMs: permutation to expert order, SiTU-GLU experts, the MoE gradient transform.

Legend: N tokens, k experts per token, E (local) experts, M rows (token copies) sorted by expert,
M_pad rows after per-expert padding, L latent width, I expert hidden width.

Forward of the fast path (`grouped_latent_experts`, what `LatentExperts` runs on CUDA):
1. Plan: sort the N·k (token, expert) pairs by expert; each expert's group is padded to a multiple of
   `align` rows (at least `align`), so every group start is 16-byte aligned for the TMA loads of the
   weight-gradient GEMM and no group is empty. M_pad = round_up(N·k, align) + E·align is static, and
   the plan needs no host synchronisation (no `.item()`, no `bincount`, whose CUDA kernel reads the max).
2. Dispatch: latent rows are gathered into their padded positions (padding rows are zero).
3. Experts: [w1; w3] as one grouped GEMM (L → 2I), fused SiTU-GLU, each activation row scaled by its
   router weight (in fp32, then cast), w2 as a grouped GEMM (I → L) — all inside one autograd Function.
4. Combine: each token's k (already weighted) rows are summed in fp32 where they lie (`sum_rows_triton`,
   one Triton kernel; a gather and a sum elsewhere); the dispatch's backward sums the same way.

The MoE gradient transform (K3 report §2.3): the router-weight gradient dp = ⟨dy, E(x)⟩ is computed
as ⟨dy·w2, act⟩ from the activation and the gradient flowing into it, so the expert outputs E(x) are
never saved; the Function saves only its input rows and the [M, 2I] pre-activations (the activation is
recomputed by the fused kernel in the backward).

`torch._grouped_mm` runs the GEMMs on CUDA in bf16 (its supported dtype there), except the weight
gradients of experts at most 1024 wide, which the Triton kernel of `k3.ops.grouped_gemm` runs faster
(`GROUPED_WGRAD`); other dtypes and devices use a per-group loop of plain matmuls (it reads the offsets
on the host: CPU and fp32/fp64 tests only; PyTorch's CPU grouped GEMM is far slower than the loop).
`naive_grouped_situ_glu` is the plain autograd reference of the public `grouped_situ_glu`.
"""

from __future__ import annotations

import torch

from k3.ops import grouped_gemm, triton_runs_on
from k3.ops.weight_grads import accumulates, add_gradient
from k3.ops.situ import (naive_situ_glu, situ_glu, situ_glu_backward, situ_glu_forward, weighted_situ_glu_backward,
                         weighted_situ_glu_forward)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch gather + sum is used
    triton = None

if triton is not None:

    @triton.jit
    def _sum_rows_kernel(Y, DEST, OUT, N, L, stride_y, K: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_L: tl.constexpr):
        """out[n] = Σ_j y[dest[n·K + j]] in fp32 for BLOCK_N tokens × BLOCK_L columns: the k rows are read
        where they lie, never gathered into a [N·K, L] copy first."""
        tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        in_n = tokens < N
        mask = in_n[:, None] & (cols[None, :] < L)
        acc = tl.zeros([BLOCK_N, BLOCK_L], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(DEST + tokens.to(tl.int64) * K + j, mask=in_n, other=0).to(tl.int64)
            acc += tl.load(Y + row[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + tokens.to(tl.int64)[:, None] * L + cols[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


_SUM_BLOCK_N, _SUM_BLOCK_L = 16, 128

if triton is not None:

    @triton.jit
    def _spread_rows_kernel(X, SRC, OUT, N, M, L, stride_x, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr):
        """out[r] = x[src[r]] (cast to out's dtype), zero where src[r] = N."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        in_m, in_l = rows < M, cols < L
        src = tl.load(SRC + rows, mask=in_m, other=N).to(tl.int64)
        v = tl.load(X + src[:, None] * stride_x + cols[None, :], mask=(src < N)[:, None] & in_l[None, :], other=0.0)
        tl.store(OUT + rows.to(tl.int64)[:, None] * L + cols[None, :], v.to(OUT.dtype.element_ty),
                 mask=in_m[:, None] & in_l[None, :])


_SPREAD_BLOCK_M, _SPREAD_BLOCK_L = 32, 128

# Which kernel runs the weight-gradient GEMMs where torch._grouped_mm could (bf16 on CUDA): "torch", "triton"
# (k3.ops.grouped_gemm) or "auto": Triton for experts at most 1024 wide, torch above. On the H200 the Triton
# kernel was faster on the small preset's experts under skewed routing (torch's slows with the largest group, it
# does not), even when balanced, and slower at K3's widths (docs/fast-paths.md). The data-gradient and forward
# GEMMs stay on torch._grouped_mm (a Triton row kernel was slower there).
GROUPED_WGRAD = "auto"
_TRITON_WGRAD_MAX_WIDTH = 1024

# Rows per expert group on CUDA: bf16 group starts on 16-byte boundaries along the token dimension.
CUDA_ALIGN = 8


def _native_ok(*mats: torch.Tensor) -> bool:
    """torch._grouped_mm's constraints: bf16 on CUDA, every row stride a multiple of 16 bytes."""
    return all(m.is_cuda and m.dtype == torch.bfloat16 and m.shape[-1] % 8 == 0 and m.shape[-2] % 8 == 0
               for m in mats)


def gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, native: bool | None = None) -> torch.Tensor:
    """Grouped a @ b: a [M, K] (rows of group g are a[offs[g-1]:offs[g]]), b [G, K, N] -> [M, N].

    offs [G] int32 cumulative group ends with offs[-1] == M.
    """
    if native if native is not None else _native_ok(a, b):
        with torch.autocast(a.device.type, enabled=False):  # operands are cast already; keep bf16 in, bf16 out
            return torch._grouped_mm(a, b, offs=offs)
    return grouped_gemm.grouped_mm_reference(a, b, offs)


def gmm_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, native: bool | None = None) -> torch.Tensor:
    """Grouped a @ b over the shared token dim: a [K, M], b [M, N] -> [G, K, N], out[g] = a[:, s:e] @ b[s:e]."""
    if native if native is not None else _native_ok(a, b):
        if _triton_wgrad(a, b):
            return grouped_gemm.grouped_mm_wgrad(a, b, offs)
        with torch.autocast(a.device.type, enabled=False):
            return torch._grouped_mm(a, b, offs=offs)
    return grouped_gemm.grouped_mm_wgrad_reference(a, b, offs)


def _triton_wgrad(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`GROUPED_WGRAD` for these operands (a [K, M], b [M, N]) on a device where Triton runs."""
    if grouped_gemm.triton is None or not triton_runs_on(a) or GROUPED_WGRAD == "torch":
        return False
    return GROUPED_WGRAD == "triton" or max(a.shape[0], b.shape[1]) <= _TRITON_WGRAD_MAX_WIDTH


class _GroupedSituGLU(torch.autograd.Function):
    """y = (p ⊙ SiTU-GLU(x W13ᵀ)) W2ᵀ per expert group; p None means unweighted. Output in x's dtype.

    x [M, L] in the compute dtype; w1, w3 [G, I, L] and w2 [G, L, I] (the parameters: cast here, w1 and w3
    stacked into one [G, 2I, L] operand); p [M] fp32/fp64 or None.
    The weight scales the activation (inside the SiTU kernel, in p's dtype, cast once) before the
    down-projection, the same product as scaling its output: y leaves the GEMM weighted and in the compute
    dtype, so no fp32 copy of the [M, L] expert outputs is made, and the combine sums k bf16 rows per token
    in fp32. The backward's SiTU kernel also returns the weighted activation (for dW2) and dp. Weight gradients
    go through `_expert_weight_grads` (added into `.grad` where `k3.ops.weight_grads` accumulates).
    """

    @staticmethod
    def forward(ctx, x, offs, w1, w3, w2, probs, beta1, beta2, native):
        ctx.params = (w1, w3, w2)
        w13, w2 = _stack_gate_up(w1, w3, x.dtype), w2.to(x.dtype)  # [G, 2I, L], [G, L, I]
        I = w2.shape[-1]
        h = gmm(x, w13.transpose(1, 2), offs, native)  # [M, 2I]
        if probs is None:
            act = situ_glu_forward(h[:, :I], h[:, I:], beta1, beta2)  # [M, I]
        else:
            act = weighted_situ_glu_forward(h[:, :I], h[:, I:], probs, beta1, beta2)
        y = gmm(act, w2.transpose(1, 2), offs, native)  # [M, L]
        ctx.save_for_backward(x, offs, w13, w2, h, probs)
        ctx.betas, ctx.native = (beta1, beta2), native
        return y

    @staticmethod
    def backward(ctx, dy):
        x, offs, w13, w2, h, probs = ctx.saved_tensors
        native = ctx.native
        I = w2.shape[-1]
        g, u = h[:, :I], h[:, I:]
        dy = dy.to(x.dtype)
        dact = gmm(dy, w2, offs, native)  # [M, I]: the gradient flowing into the (weighted) activation
        dh = torch.empty_like(h)  # [M, 2I] = [dg | du]
        dprobs = None
        if probs is None:
            act = situ_glu_forward(g, u, *ctx.betas)  # recomputed, never saved
            situ_glu_backward(g, u, dact, *ctx.betas, out=dh)
        else:
            # the transform: dp_m = ⟨dy_m, E(x_m)⟩ = ⟨dy_m · w2, act_m⟩, from the recomputed activation
            act, dprobs = weighted_situ_glu_backward(g, u, dact, probs, *ctx.betas, out=dh)
        w1, w3, w2_param = ctx.params
        need = ctx.needs_input_grad
        dw1 = dw2 = dw3 = None
        if need[4]:
            dw2, = _expert_weight_grads((w2_param,), dy.t(), act, offs, native)  # [G, L, I]
        dx = gmm(dh, w13, offs, native)  # [M, L]
        if need[2] or need[3]:  # one [w1; w3] product: a frozen one's part is dropped
            dw1, dw3 = _expert_weight_grads((w1, w3), dh.t(), x, offs, native)  # [G, 2I, L] split
            dw1, dw3 = (dw1 if need[2] else None), (dw3 if need[3] else None)
        return dx, None, dw1, dw3, dw2, dprobs, None, None, None


def _expert_weight_grads(params: tuple, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, native) -> list:
    """The grouped weight gradient a @ b ([G, ΣK_i, N], rows split between `params` in order), per parameter:
    added into its `.grad` (None returned) where `k3.ops.weight_grads` accumulates, on the Triton kernel in
    fp32 where it runs; else returned in the operands' dtype."""
    if _kernel_takes_weight_grads(params, a, b, native):
        accumulate = params[0].grad is not None
        outs = [p.grad for p in params] if accumulate else [torch.empty_like(p) for p in params]
        grouped_gemm.grouped_mm_wgrad_into(a, b, offs, outs, accumulate)
        if not accumulate:
            for p, out in zip(params, outs):
                p.grad = out
        return [None] * len(params)
    dw = gmm_wgrad(a, b, offs, native)
    parts = dw.split([p.shape[1] for p in params], dim=1) if len(params) > 1 else [dw]
    return [add_gradient(p, part) for p, part in zip(params, parts)]


def _kernel_takes_weight_grads(params: tuple, a: torch.Tensor, b: torch.Tensor, native) -> bool:
    """Whether the Triton weight-gradient kernel writes these parameters' .grad itself: they all accumulate in
    place, the operands are the kernel's (`_triton_wgrad`), and their .grad are all present (of one layout, as
    the kernel's outputs must be) or all absent: one launch either adds into every output or writes every one."""
    if not (all(accumulates(p) for p in params) and (native if native is not None else _native_ok(a, b))
            and _triton_wgrad(a, b)):
        return False
    grads = [p.grad for p in params]
    if all(g is None for g in grads):
        return True
    return all(g is not None and g.stride() == grads[0].stride() for g in grads)


def _source_rows(dest: torch.Tensor, k: int, rows: int) -> torch.Tensor:
    """The inverse of the dispatch: src [rows] = the token of each padded row, N (one past the last token)
    for padding rows."""
    n_tokens = dest.numel() // k
    src = torch.full((rows,), n_tokens, dtype=dest.dtype, device=dest.device)
    return src.scatter_(0, dest, torch.arange(dest.numel(), device=dest.device) // k)


def _spread_rows(x: torch.Tensor, src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[r] = x[src[r]] in `dtype` (default x's), zero where src[r] = len(x): one gather into the k× larger
    [rows, L] output, instead of zero-filling it and scattering k copies of every token into it. Where Triton
    runs, one kernel that casts while it copies (the torch form first appends a zero row to x, a copy of x, and
    casts in another pass)."""
    dtype = dtype or x.dtype
    low = (torch.float32, torch.bfloat16, torch.float16)
    if triton is not None and triton_runs_on(x) and x.dtype in low and dtype in low and x.stride(-1) == 1:
        return spread_rows_triton(x, src, dtype)
    return torch.cat([x, x.new_zeros(1, x.shape[-1])]).to(dtype).index_select(0, src)


def spread_rows_triton(x: torch.Tensor, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel of `_spread_rows`: x [N, L] (unit column stride), src [M] in [0, N] -> [M, L] in dtype."""
    (N, L), M = x.shape, src.numel()
    out = torch.empty(M, L, dtype=dtype, device=x.device)
    grid = (triton.cdiv(M, _SPREAD_BLOCK_M), triton.cdiv(L, _SPREAD_BLOCK_L))
    _spread_rows_kernel[grid](x, src, out, N, M, L, x.stride(0), BLOCK_M=_SPREAD_BLOCK_M, BLOCK_L=_SPREAD_BLOCK_L)
    return out


def _sum_rows(y: torch.Tensor, dest: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """out[n] = Σ_j y[dest[n·k + j]], summed in `dtype` (fp32 inside the kernel)."""
    if k == 1 and dtype == y.dtype:
        return y.index_select(0, dest)
    low = (torch.float32, torch.bfloat16, torch.float16)  # the kernel sums in fp32: fp64 stays on torch
    if triton is not None and triton_runs_on(y) and y.dtype in low and dtype in low and y.stride(-1) == 1:
        return sum_rows_triton(y, dest, k, dtype)
    with torch.autocast(y.device.type, enabled=False):
        return y.index_select(0, dest).view(-1, k, y.shape[-1]).sum(1, dtype=dtype)


def sum_rows_triton(y: torch.Tensor, dest: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The fused kernel of `_sum_rows`: y [M, L] (unit column stride), dest [N·k] -> [N, L] in dtype."""
    N, L = dest.numel() // k, y.shape[-1]
    out = torch.empty(N, L, dtype=dtype, device=y.device)
    grid = (triton.cdiv(N, _SUM_BLOCK_N), triton.cdiv(L, _SUM_BLOCK_L))
    _sum_rows_kernel[grid](y, dest, out, N, L, y.stride(0), K=k, BLOCK_N=_SUM_BLOCK_N, BLOCK_L=_SUM_BLOCK_L)
    return out


class _ScatterRows(torch.autograd.Function):
    """out [M_pad, L] with out[dest[i]] = x[i // k], padding rows zero; backward sums each token's k row
    gradients (in x's dtype)."""

    @staticmethod
    def forward(ctx, x, dest, src, k):
        ctx.save_for_backward(dest)
        ctx.k = k
        return _spread_rows(x, src)

    @staticmethod
    def backward(ctx, grad):
        (dest,) = ctx.saved_tensors
        return _sum_rows(grad, dest, ctx.k, grad.dtype), None, None, None


class _GatherRows(torch.autograd.Function):
    """out [N, L] = Σ_j y[dest[n·k + j]] summed in `accum` (fp32 for bf16 rows); backward spreads the token
    gradient to its k rows in y's dtype (the kernel casts while it copies)."""

    @staticmethod
    def forward(ctx, y, dest, src, k, accum):
        ctx.save_for_backward(src)
        ctx.dtype = y.dtype
        return _sum_rows(y, dest, k, accum)

    @staticmethod
    def backward(ctx, grad):
        (src,) = ctx.saved_tensors
        return _spread_rows(grad, src, ctx.dtype), None, None, None, None


def _round_up(x, a):
    return (x + a - 1) // a * a


def padded_offsets(sizes: torch.Tensor, align: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group sizes [G] int64 -> (padded starts [G] int64, offs [G] int32 ends with offs[-1] = rows).

    Each group gets round_up(size, align) rows, at least `align`; the last group absorbs the tail up to
    `rows`, which must be >= round_up(Σ sizes, align) + G·align.
    """
    padded = torch.clamp(_round_up(sizes, align), min=align)
    ends = padded.cumsum(0)
    # built on the device: `offs[-1] = rows` would copy a host scalar (a synchronising copy)
    offs = torch.cat([ends[:-1], ends.new_full((1,), rows)]).to(torch.int32)
    return ends - padded, offs


def dispatch_plan(topk_idx: torch.Tensor, num_experts: int, align: int):
    """topk_idx [N, k] -> (dest [N·k] padded row of pair n·k + j, offs [E] int32, M_pad). No host sync."""
    N, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # sorted position -> pair
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    rows = _round_up(N * k, align) + num_experts * align
    pad_start, offs = padded_offsets(counts, align, rows)
    expert_sorted = flat[order]
    shift = pad_start - (counts.cumsum(0) - counts)  # padded start − unpadded start, per expert
    pos_sorted = torch.arange(N * k, device=flat.device) + shift[expert_sorted]
    dest = torch.empty_like(order).scatter_(0, order, pos_sorted)
    return dest, offs, rows


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return x.dtype


def _stack_gate_up(w1: torch.Tensor, w3: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[w1; w3] as one [E, 2I, L] operand in the compute dtype, cast while copying (one pass over the
    master weights; concatenating then casting would read and write them three times)."""
    E, I, L = w1.shape
    w13 = torch.empty(E, 2 * I, L, dtype=dtype, device=w1.device)
    w13[:, :I].copy_(w1)
    w13[:, I:].copy_(w3)
    return w13


def grouped_latent_experts(z: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                           w3: torch.Tensor, w2: torch.Tensor, beta1: float, beta2: float,
                           align: int | None = None, native: bool | None = None) -> torch.Tensor:
    """Σ_j weights_j · E_j(z) as grouped GEMMs: z [N, L], topk_idx [N, k], weights [N, k] -> [N, L] fp32.

    Same contract as `LatentExperts.forward` (the reference); fp64 inputs give fp64.
    """
    N, k = topk_idx.shape
    E = w1.shape[0]
    align = align or (CUDA_ALIGN if z.is_cuda else 1)
    dtype = _compute_dtype(z)
    accum = torch.float64 if z.dtype == torch.float64 else torch.float32
    dest, offs, rows = dispatch_plan(topk_idx, E, align)
    src = _source_rows(dest, k, rows)
    x = _ScatterRows.apply(z.to(dtype), dest, src, k)  # [M_pad, L]
    probs = weights.new_zeros(rows, dtype=accum).index_put((dest,), weights.reshape(-1).to(accum))
    y = _GroupedSituGLU.apply(x, offs, w1, w3, w2, probs, beta1, beta2, native)  # [M_pad, L]
    return _GatherRows.apply(y, dest, src, k, accum)


def gathered_latent_experts(z: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                            w3: torch.Tensor, w2: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """Same contract as `grouped_latent_experts`, for a few (token, expert) pairs: each pair's three expert
    matrices are gathered and applied as batched matrix-vector products.

    The grouped path gives every expert at least `align` padded rows and restacks all gate/up weights per call, so
    on a decode step (N·k pairs far fewer than E·align rows) it reads every expert; this path reads the selected
    ones only (a copy each, then the product). `LatentExperts` takes it when N·k ≤ E/2.
    """
    N, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    dtype = _compute_dtype(z)
    accum = torch.float64 if z.dtype == torch.float64 else torch.float32
    x = z.to(dtype)[:, None, :].expand(N, k, z.shape[1]).reshape(N * k, z.shape[1], 1)  # [N·k, L, 1]
    gate = torch.bmm(w1.index_select(0, flat).to(dtype), x)[..., 0]  # [N·k, I]
    up = torch.bmm(w3.index_select(0, flat).to(dtype), x)[..., 0]
    act = (situ_glu if gate.is_cuda else naive_situ_glu)(gate, up, beta1, beta2)
    y = torch.bmm(w2.index_select(0, flat).to(dtype), act[..., None])[..., 0]  # [N·k, L]
    return (y.to(accum) * weights.reshape(-1, 1).to(accum)).view(N, k, -1).sum(1)


def grouped_situ_glu(x: torch.Tensor, group_sizes: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                     w2: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """SiTU-GLU experts on rows sorted by expert, as grouped GEMMs; differentiable.

    x [M, L] rows sorted by group; group_sizes [G] int (rows of expert g, Σ = M); w1, w3 [G, I, L];
    w2 [G, L, I]. Returns [M, L] in the compute dtype (x's, or autocast's on CUDA). Rows are placed
    into padded groups internally (no host sync); see `naive_grouped_situ_glu` for the reference.
    """
    return _grouped_situ_glu(x, group_sizes, w1, w3, w2, beta1, beta2)


def _grouped_situ_glu(x, group_sizes, w1, w3, w2, beta1, beta2, align=None, native=None):
    M, L = x.shape
    G = w1.shape[0]
    if tuple(group_sizes.shape) != (G,):
        raise ValueError(f"group_sizes must be [{G}] (one per expert), got {tuple(group_sizes.shape)}")
    align = align or (CUDA_ALIGN if x.is_cuda else 1)
    dtype = _compute_dtype(x)
    sizes = group_sizes.to(device=x.device, dtype=torch.int64)
    rows = _round_up(M, align) + G * align
    pad_start, offs = padded_offsets(sizes, align, rows)
    group_of = torch.repeat_interleave(torch.arange(G, device=x.device), sizes, output_size=M)  # [M]
    dest = torch.arange(M, device=x.device) + (pad_start - (sizes.cumsum(0) - sizes))[group_of]
    src = _source_rows(dest, 1, rows)
    xp = _ScatterRows.apply(x.to(dtype), dest, src, 1)
    y = _GroupedSituGLU.apply(xp, offs, w1, w3, w2, None, beta1, beta2, native)
    return _GatherRows.apply(y, dest, src, 1, y.dtype)


def naive_grouped_situ_glu(x: torch.Tensor, group_sizes: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                           w2: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """Reference of `grouped_situ_glu`: a loop over experts with plain matmuls and autograd."""
    outs, start = [], 0
    for g, n in enumerate(group_sizes.tolist()):
        rows = x[start:start + n]
        outs.append(naive_situ_glu(rows @ w1[g].t(), rows @ w3[g].t(), beta1, beta2) @ w2[g].t())
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])
