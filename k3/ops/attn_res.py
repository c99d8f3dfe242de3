"""Fused Block AttnRes read (Triton): the depth-softmax over n sources without stacking them.

Legend: n sources, N rows (B·T tokens), D model width.

    AR(w; v_1..v_n) = Σ_i α_i v_i,  α = softmax_i(s),  s_i = r_i (w · v_i),  r_i = (mean(v_i²) + ε)^(-1/2)

The reference (`k3.model.attn_res.attn_res_read`) stacks the sources into one fp32 [n, N, D] tensor
for every read and autograd saves it, so each decoder layer holds two fresh copies of every sealed
block. Here the n source tensors are passed to the kernel as a tuple: the forward reads each once
with an online softmax and writes the result plus one fp32 logsumexp per row; the backward reads each
source twice (logits, then gradients) and writes one gradient per source. Nothing else is saved.

Backward per row, with c = Σ_j α_j (dout · v_j) and ds_i = α_i (dout · v_i − c):
dv_i = α_i dout + ds_i (r_i w − (w · v_i) r_i³ v_i / D),   dw = Σ_rows Σ_i ds_i r_i v_i.
The number of sources is a compile-time constant (one specialisation per n ≤ the number of blocks + 1).

The two-phase form for training (`attn_res_phase1_triton` + `attn_res_merge_triton`, the fused version of
`k3.model.attn_res.attn_res_phase1` / `attn_res_merge`). The J reads of one block share its sealed sources,
and their queries are parameters, so all J are computed in one pass at the block's start:

    phase 1:  o1_j = Σ_i α_ji v_i,  α_j = softmax_i(s_ji),  s_ji = r_i (w_j · v_i),  lse1_j = logsumexp_i s_ji
    merge:    out = β1 o1_j + β2 p,  (β1, β2) = softmax(lse1_j, s_p),  s_p = r_p (w · p)   (p: the partial sum)

Each sealed source is then read once per block forward (twice backward) instead of once per read, and its
gradient is summed over the block's J reads inside the kernel: one gradient per source and block, where the
direct form writes one per read and the autograd engine adds them up. Phase-1 backward, with g_j = dL/do1_j
and e_j = dL/dlse1_j: dα_ji = g_j · v_i, c_j = Σ_i α_ji dα_ji, ds_ji = α_ji (dα_ji − c_j + e_j),
dv_i = Σ_j α_ji g_j + r_i Σ_j ds_ji w_j − (r_i³ / D) (Σ_j ds_ji (w_j · v_i)) v_i,
dw_j = Σ_rows Σ_i ds_ji r_i v_i.
The J accumulators of a row live in registers ([J, D] per row), so the fused form serves J · D ≤ 8192 padded
to powers of two (`two_phase_fits`: the small preset's J = 7, D = 768; not K3's J = 25, D = 7168, where
"two_phase" runs the torch form).
"""

from __future__ import annotations

import torch

from k3.ops import interpreting
from k3.ops.norm import num_warps, persistent_grid

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

EPS = 1e-5


if triton is not None:

    @triton.jit
    def _row_tile(block, N, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """Row block `block` over all D columns: (rows, row mask, tile mask, int64 offsets into [N, D])."""
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_D)
        rmask = rows < N
        mask = rmask[:, None] & (cols[None, :] < D)
        return rows, rmask, mask, rows[:, None].to(tl.int64) * D + cols[None, :]

    @triton.jit
    def _inv_rms(v, D, eps):
        """1 / RMS of each row of v [rows, D] in fp32: the keys' normalisation (no gain)."""
        return 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)

    @triton.jit
    def _ar_fwd_kernel(srcs, W, OUT, LSE, N, D, eps, NS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        rows, rmask, mask, offs = _row_tile(tl.program_id(0), N, D, BLOCK_M, BLOCK_D)
        cols = tl.arange(0, BLOCK_D)
        w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(NS):
            v = tl.load(srcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            r = _inv_rms(v, D, eps)
            s = tl.sum(v * w[None, :], axis=1) * r
            m_new = tl.maximum(m, s)
            scale = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            acc = acc * scale[:, None] + p[:, None] * v
            l = l * scale + p
            m = m_new
        tl.store(OUT + offs, (acc / l[:, None]).to(OUT.dtype.element_ty), mask=mask)
        tl.store(LSE + rows, m + tl.log(l), mask=rmask)

    @triton.jit
    def _ar_bwd_kernel(srcs, dsrcs, W, DOUT, LSE, DW_PART, N, D, eps, NS: tl.constexpr, NS_PAD: tl.constexpr,
                       ITERS: tl.constexpr, ACCUMULATE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        # ACCUMULATE: bit i set -> dsrcs[i] already holds other reads' gradient of source i; add to it
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        src_id = tl.arange(0, NS_PAD)
        dw = tl.zeros([BLOCK_D], dtype=tl.float32)
        for it in range(ITERS):
            rows, rmask, mask, offs = _row_tile(pid * ITERS + it, N, D, BLOCK_M, BLOCK_D)
            dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
            lse = tl.load(LSE + rows, mask=rmask, other=0.0)
            # pass 1: per-source scalars of every row, kept as [BLOCK_M, NS_PAD] tables
            alpha = tl.zeros([BLOCK_M, NS_PAD], dtype=tl.float32)
            dalpha = tl.zeros([BLOCK_M, NS_PAD], dtype=tl.float32)
            rinv = tl.zeros([BLOCK_M, NS_PAD], dtype=tl.float32)
            dots = tl.zeros([BLOCK_M, NS_PAD], dtype=tl.float32)
            c = tl.zeros([BLOCK_M], dtype=tl.float32)
            for i in tl.static_range(NS):
                v = tl.load(srcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
                r = _inv_rms(v, D, eps)
                dot = tl.sum(v * w[None, :], axis=1)
                a = tl.exp(dot * r - lse)
                da = tl.sum(dout * v, axis=1)
                c += a * da
                sel = src_id[None, :] == i
                alpha = tl.where(sel, a[:, None], alpha)
                dalpha = tl.where(sel, da[:, None], dalpha)
                rinv = tl.where(sel, r[:, None], rinv)
                dots = tl.where(sel, dot[:, None], dots)
            # pass 2: gradients of every source, and this program's share of dw
            for i in tl.static_range(NS):
                sel = src_id[None, :] == i
                a = tl.sum(tl.where(sel, alpha, 0.0), axis=1)
                da = tl.sum(tl.where(sel, dalpha, 0.0), axis=1)
                r = tl.sum(tl.where(sel, rinv, 0.0), axis=1)
                dot = tl.sum(tl.where(sel, dots, 0.0), axis=1)
                v = tl.load(srcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
                ds = a * (da - c)
                dv = a[:, None] * dout + ds[:, None] * (r[:, None] * w[None, :] - (dot * r * r * r / D)[:, None] * v)
                if (ACCUMULATE >> i) & 1:  # the sum in fp32, or in the buffer's fp64
                    prev = tl.load(dsrcs[i] + offs, mask=mask, other=0.0)
                    if prev.dtype == tl.float64:
                        dv = dv.to(tl.float64) + prev
                    else:
                        dv += prev.to(tl.float32)
                tl.store(dsrcs[i] + offs, dv.to(dsrcs[i].dtype.element_ty), mask=mask)
                dw += tl.sum((ds * r)[:, None] * v, axis=0)
        tl.store(DW_PART + pid * D + cols, dw, mask=cmask)

    @triton.jit
    def _p1_fwd_kernel(srcs, WQ, O1, LSE1, N, D, eps, NS: tl.constexpr, J: tl.constexpr, JP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """Phase 1 forward: every query j of the block over the sealed sources, one online softmax per query;
        O1 [J, N, D] fp32, LSE1 [J, N]. Tiles are [JP queries, BLOCK_M rows, BLOCK_D columns]."""
        rows, rmask, mask, offs = _row_tile(tl.program_id(0), N, D, BLOCK_M, BLOCK_D)
        cols = tl.arange(0, BLOCK_D)
        qs = tl.arange(0, JP)
        wq = tl.load(WQ + qs[:, None] * D + cols[None, :], mask=(qs[:, None] < J) & (cols[None, :] < D), other=0.0)
        m = tl.full([JP, BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([JP, BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([JP, BLOCK_M, BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(NS):
            v = tl.load(srcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            r = _inv_rms(v, D, eps)
            s = tl.sum(wq[:, None, :] * v[None, :, :], axis=2) * r[None, :]
            m_new = tl.maximum(m, s)
            scale = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            acc = acc * scale[:, :, None] + p[:, :, None] * v[None, :, :]
            l = l * scale + p
            m = m_new
        q_rows = qs[:, None].to(tl.int64) * N + rows[None, :]
        qmask = (qs[:, None] < J) & rmask[None, :]
        tl.store(O1 + q_rows[:, :, None] * D + cols[None, None, :], acc / l[:, :, None],
                 mask=qmask[:, :, None] & (cols[None, None, :] < D))
        tl.store(LSE1 + q_rows, m + tl.log(l), mask=qmask)

    @triton.jit
    def _p1_bwd_kernel(srcs, dsrcs, WQ, LSE1, grads, E, DWQ_PART, N, D, eps, NS: tl.constexpr, J: tl.constexpr,
                       JP: tl.constexpr, ITERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """Phase 1 backward: one gradient per source over all J queries, and this program's share of dw_j.
        `grads`: the J o1 gradients (separate fp32 [N, D] tensors, read in place); E [J, N] the lse1 gradients.
        Each source is read twice per row block (the second time from cache)."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        qs = tl.arange(0, JP)
        cmask = cols < D
        qmask = qs < J
        wq = tl.load(WQ + qs[:, None] * D + cols[None, :], mask=qmask[:, None] & cmask[None, :], other=0.0)
        dwq = tl.zeros([JP, BLOCK_D], dtype=tl.float32)
        for it in range(ITERS):
            rows, rmask, mask, offs = _row_tile(pid * ITERS + it, N, D, BLOCK_M, BLOCK_D)
            q_rows = qs[:, None].to(tl.int64) * N + rows[None, :]
            qr_mask = qmask[:, None] & rmask[None, :]
            g = tl.zeros([JP, BLOCK_M, BLOCK_D], dtype=tl.float32)
            for j in tl.static_range(J):
                g = tl.where(qs[:, None, None] == j, tl.load(grads[j] + offs, mask=mask, other=0.0)[None, :, :], g)
            lse1 = tl.load(LSE1 + q_rows, mask=qr_mask, other=0.0)
            e = tl.load(E + q_rows, mask=qr_mask, other=0.0)
            # pass 1: c_j = Σ_i α_ji dα_ji (= g_j · o1_j)
            c = tl.zeros([JP, BLOCK_M], dtype=tl.float32)
            for i in tl.static_range(NS):
                v = tl.load(srcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
                r = _inv_rms(v, D, eps)
                dots = tl.sum(wq[:, None, :] * v[None, :, :], axis=2)
                alpha = tl.where(qr_mask, tl.exp(dots * r[None, :] - lse1), 0.0)
                c += alpha * tl.sum(g * v[None, :, :], axis=2)
            # pass 2: each source's gradient, summed over the queries
            for i in tl.static_range(NS):
                v = tl.load(srcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
                r = _inv_rms(v, D, eps)
                dots = tl.sum(wq[:, None, :] * v[None, :, :], axis=2)
                alpha = tl.where(qr_mask, tl.exp(dots * r[None, :] - lse1), 0.0)
                ds = alpha * (tl.sum(g * v[None, :, :], axis=2) - c + e)
                dv = (tl.sum(alpha[:, :, None] * g, axis=0)
                      + r[:, None] * tl.sum(ds[:, :, None] * wq[:, None, :], axis=0)
                      - (r * r * r / D * tl.sum(ds * dots, axis=0))[:, None] * v)
                tl.store(dsrcs[i] + offs, dv.to(dsrcs[i].dtype.element_ty), mask=mask)
                dwq += tl.sum((ds * r[None, :])[:, :, None] * v[None, :, :], axis=1)
        tl.store(DWQ_PART + pid * J * D + qs[:, None] * D + cols[None, :], dwq, mask=qmask[:, None] & cmask[None, :])

    @triton.jit
    def _merge_fwd_kernel(O1, LSE1, W, P, OUT, LSE, N, D, eps, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """Phase 2: out = β1 o1 + β2 p with (β1, β2) = softmax(lse1, r_p (w · p)); LSE = the merged logsumexp."""
        rows, rmask, mask, offs = _row_tile(tl.program_id(0), N, D, BLOCK_M, BLOCK_D)
        cols = tl.arange(0, BLOCK_D)
        w = tl.load(W + cols, mask=cols < D, other=0.0)
        p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
        o1 = tl.load(O1 + offs, mask=mask, other=0.0)
        lse1 = tl.load(LSE1 + rows, mask=rmask, other=0.0)
        s = tl.sum(p * w[None, :], axis=1) / tl.sqrt(tl.sum(p * p, axis=1) / D + eps)
        m = tl.maximum(lse1, s)
        b1 = tl.exp(lse1 - m)
        b2 = tl.exp(s - m)
        total = b1 + b2
        out = (b1[:, None] * o1 + b2[:, None] * p) / total[:, None]
        tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask=mask)
        tl.store(LSE + rows, m + tl.log(total), mask=rmask)

    @triton.jit
    def _merge_bwd_kernel(O1, LSE1, W, P, LSE, DOUT, DO1, DLSE1, DP, DW_PART, N, D, eps, ITERS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """Phase 2 backward: do1 = β1 dout, ds = β1 β2 (dout · p − dout · o1) (= β2 (dout · p − dout · out),
        without the cancellation when one weight is near 1), dlse1 = −ds,
        dp = β2 dout + ds (r w − (w · p) r³ p / D), and this program's share of dw = Σ_rows ds r p."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        w = tl.load(W + cols, mask=cmask, other=0.0)
        dw = tl.zeros([BLOCK_D], dtype=tl.float32)
        for it in range(ITERS):
            rows, rmask, mask, offs = _row_tile(pid * ITERS + it, N, D, BLOCK_M, BLOCK_D)
            p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
            o1 = tl.load(O1 + offs, mask=mask, other=0.0)
            dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
            lse1 = tl.load(LSE1 + rows, mask=rmask, other=0.0)
            lse = tl.load(LSE + rows, mask=rmask, other=0.0)
            r = _inv_rms(p, D, eps)
            dot = tl.sum(p * w[None, :], axis=1)
            b1 = tl.where(rmask, tl.exp(lse1 - lse), 0.0)
            b2 = tl.where(rmask, tl.exp(dot * r - lse), 0.0)
            d1 = tl.sum(dout * o1, axis=1)
            d2 = tl.sum(dout * p, axis=1)
            ds = b1 * b2 * (d2 - d1)
            tl.store(DO1 + offs, b1[:, None] * dout, mask=mask)
            tl.store(DLSE1 + rows, -ds, mask=rmask)
            dp = b2[:, None] * dout + ds[:, None] * (r[:, None] * w[None, :] - (dot * r * r * r / D)[:, None] * p)
            tl.store(DP + offs, dp.to(DP.dtype.element_ty), mask=mask)
            dw += tl.sum((ds * r)[:, None] * p, axis=0)
        tl.store(DW_PART + pid * D + cols, dw, mask=cmask)


def _blocks(D: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(D)
    return max(1, min(16, 2048 // block_d)), block_d


# The direct read's launch settings, set by `benchmarks/attn_res.py --tiles`, which times them at the small preset's
# shape. None: rows of at most `one_warp_width` (padded) columns one per program on one warp, 16 backward programs
# per SM; wider rows `_blocks` and `num_warps`, 4 backward programs per SM. One warp keeps a row's sums inside the
# warp (shuffles): across 4 warps every per-source sum of the backward waits on a shared-memory barrier, so one
# warp per row beat 4 warps, 2 warps and 2 rows per warp (the variants that lost: docs/fast-paths.md).
READ_TILES: dict = {"block_m": None, "num_warps": None, "bwd_per_sm": None, "one_warp_width": 1024}


def _read_tiles(D: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_D, warps) of the direct read's kernels."""
    block_m, block_d = _blocks(D)
    if _one_warp_rows(block_d):
        return READ_TILES["block_m"] or 1, block_d, READ_TILES["num_warps"] or 1
    block_m = READ_TILES["block_m"] or block_m
    return block_m, block_d, READ_TILES["num_warps"] or num_warps(block_m * block_d)


def _one_warp_rows(block_d: int) -> bool:
    # not in the interpreter, which pays per program (the tile form is the same kernel at BLOCK_M > 1; the
    # interpreter checks run one-row tiles once, `attn_res(..., one_row=True)`)
    return block_d <= READ_TILES["one_warp_width"] and not interpreting()


def _bwd_per_sm(D: int) -> int:
    """Backward programs per SM of the direct read (`READ_TILES`)."""
    return READ_TILES["bwd_per_sm"] or (16 if _one_warp_rows(triton.next_power_of_2(D)) else 4)


class ReadGradientSink:
    """The gradient of one sealed AttnRes source, summed by the fused reads' backward kernels themselves.

    A sealed block is a source of every later read (up to two per layer). Left to autograd, each read's backward
    writes one gradient per source and the engine adds them up: per read and source one write plus an add that
    reads two tensors and writes one. With a sink the first read (in backward order) writes the buffer and every
    later one adds into it inside its kernel (one read and one write), and `_SealedSource` hands the sum to
    autograd once all reads have run (the engine runs a node only after all of its consumers)."""

    __slots__ = ("grad",)

    def __init__(self):
        self.grad: torch.Tensor | None = None


_SINK_ATTRIBUTE = "_attn_res_gradient_sink"


class _SealedSource(torch.autograd.Function):
    """Identity whose backward adds the sink's sum to whatever gradient other consumers sent."""

    @staticmethod
    def forward(ctx, source, sink):
        ctx.sink, ctx.shape = sink, source.shape
        ctx.set_materialize_grads(False)  # the reads send None: no zeros tensor for them
        return source.view_as(source)

    @staticmethod
    def backward(ctx, grad):
        summed, ctx.sink.grad = ctx.sink.grad, None  # the buffer is [N, D]; the source may be [B, T, D]
        if summed is None:
            return grad, None
        summed = summed.view(ctx.shape)
        return (summed if grad is None else grad + summed), None


def seal_source(source: torch.Tensor) -> torch.Tensor:
    """`source` as a sealed source of fused reads (`attn_res_read_triton`): the same values, whose gradient the
    reads' backward kernels accumulate in one buffer (`ReadGradientSink`) instead of returning one per read.
    Without a gradient to follow it is `source` itself."""
    if not (torch.is_grad_enabled() and source.requires_grad):
        return source
    sink = ReadGradientSink()
    sealed = _SealedSource.apply(source, sink)
    setattr(sealed, _SINK_ATTRIBUTE, sink)
    return sealed


class _AttnResRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, eps, *sources):
        shape = sources[0].shape
        D = shape[-1]
        flat = tuple(s.reshape(-1, D).contiguous() for s in sources)
        N = flat[0].shape[0]
        BLOCK_M, BLOCK_D, warps = _read_tiles(D)
        out = torch.empty(N, D, dtype=sources[0].dtype, device=w.device)
        lse = torch.empty(N, dtype=torch.float32, device=w.device)
        w32 = w.float().contiguous()
        _ar_fwd_kernel[(triton.cdiv(N, BLOCK_M),)](flat, w32, out, lse, N, D, float(eps), NS=len(flat),
                                                   BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, num_warps=warps)
        ctx.save_for_backward(w32, lse, *flat)
        ctx.shape, ctx.eps, ctx.w_dtype = shape, eps, w.dtype
        ctx.sinks = tuple(getattr(s, _SINK_ATTRIBUTE, None) for s in sources)
        return out.view(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        w32, lse, *flat = ctx.saved_tensors
        N, D = flat[0].shape
        BLOCK_M, BLOCK_D, warps = _read_tiles(D)
        P, iters = persistent_grid(N, BLOCK_M, w32.device, _bwd_per_sm(D))
        # a sealed source's gradient goes into its sink: the first read to run backward writes the buffer,
        # the later ones add into it (bit i of `accumulate`)
        dsrcs, accumulate = [], 0
        for i, (s, sink) in enumerate(zip(flat, ctx.sinks)):
            if sink is not None and sink.grad is not None:
                dsrcs.append(sink.grad)
                accumulate |= 1 << i
            else:
                dsrcs.append(torch.empty_like(s))
        part = torch.empty(P, D, dtype=torch.float32, device=w32.device)
        args = (tuple(flat), tuple(dsrcs), w32, dout.reshape(N, D).contiguous(), lse, part, N, D, float(ctx.eps))
        _ar_bwd_kernel[(P,)](*args, NS=len(flat), NS_PAD=triton.next_power_of_2(len(flat)), ITERS=iters,
                             ACCUMULATE=accumulate, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, num_warps=warps)
        grads = []
        for d, sink in zip(dsrcs, ctx.sinks):
            if sink is None:
                grads.append(d.view(ctx.shape))
            else:
                sink.grad = d
                grads.append(None)
        dw = part.sum(0).to(ctx.w_dtype)
        return (dw, None, *grads)


def _two_phase_tiles(J: int, D: int) -> tuple[int, int, int]:
    """(JP, BLOCK_M, BLOCK_D) of the phase-1 kernels: J queries padded to a power of two, ≤ 8192 elements."""
    JP, block_d = triton.next_power_of_2(J), triton.next_power_of_2(D)
    return JP, max(1, min(16, 8192 // (JP * block_d))), block_d


class _AttnResPhase1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, queries, eps, *sources):
        shape = sources[0].shape
        J, D = queries.shape
        flat = tuple(s.reshape(-1, D).contiguous() for s in sources)
        N = flat[0].shape[0]
        JP, BLOCK_M, BLOCK_D = _two_phase_tiles(J, D)
        wq = queries.float().contiguous()
        o1 = torch.empty(J, N, D, dtype=torch.float32, device=wq.device)
        lse1 = torch.empty(J, N, dtype=torch.float32, device=wq.device)
        _p1_fwd_kernel[(triton.cdiv(N, BLOCK_M),)](flat, wq, o1, lse1, N, D, float(eps), NS=len(flat), J=J, JP=JP,
                                                   BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
                                                   num_warps=num_warps(JP * BLOCK_M * BLOCK_D))
        ctx.save_for_backward(wq, lse1, *flat)
        ctx.shape, ctx.eps, ctx.q_dtype = shape, eps, queries.dtype
        return (*o1.view(J, *shape).unbind(0), *lse1.view(J, *shape[:-1]).unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        wq, lse1, *flat = ctx.saved_tensors
        J, D = wq.shape
        N = flat[0].shape[0]
        JP, BLOCK_M, BLOCK_D = _two_phase_tiles(J, D)
        # autograd hands in zeros for outputs that took no gradient (materialised grads)
        g = [grad.reshape(N, D).float().contiguous() for grad in grads[:J]]
        e = torch.stack([grad.reshape(N).float() for grad in grads[J:]])
        P, iters = persistent_grid(N, BLOCK_M, wq.device)
        dsrcs = tuple(torch.empty_like(s) for s in flat)
        part = torch.empty(P, J, D, dtype=torch.float32, device=wq.device)
        _p1_bwd_kernel[(P,)](tuple(flat), dsrcs, wq, lse1, tuple(g), e, part, N, D, float(ctx.eps), NS=len(flat),
                             J=J, JP=JP, ITERS=iters, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
                             num_warps=num_warps(JP * BLOCK_M * BLOCK_D))
        return (part.sum(0).to(ctx.q_dtype), None, *(d.view(ctx.shape) for d in dsrcs))


class _AttnResMerge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o1, lse1, w, partial, eps):
        shape, D = partial.shape, partial.shape[-1]
        o1f, pf = o1.reshape(-1, D).contiguous(), partial.reshape(-1, D).contiguous()
        N = pf.shape[0]
        lse1f = lse1.reshape(N).contiguous()
        BLOCK_M, BLOCK_D = _blocks(D)
        w32 = w.float().contiguous()
        out = torch.empty(N, D, dtype=partial.dtype, device=partial.device)
        lse = torch.empty(N, dtype=torch.float32, device=partial.device)
        _merge_fwd_kernel[(triton.cdiv(N, BLOCK_M),)](o1f, lse1f, w32, pf, out, lse, N, D, float(eps),
                                                      BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
                                                      num_warps=num_warps(BLOCK_M * BLOCK_D))
        ctx.save_for_backward(o1f, lse1f, w32, pf, lse)
        ctx.shapes, ctx.eps, ctx.w_dtype = (o1.shape, lse1.shape, shape), eps, w.dtype
        return out.view(shape)

    @staticmethod
    def backward(ctx, dout):
        o1, lse1, w32, p, lse = ctx.saved_tensors
        N, D = p.shape
        BLOCK_M, BLOCK_D = _blocks(D)
        P, iters = persistent_grid(N, BLOCK_M, p.device)
        do1 = torch.empty(N, D, dtype=torch.float32, device=p.device)
        dlse1 = torch.empty(N, dtype=torch.float32, device=p.device)
        dp = torch.empty_like(p)
        part = torch.empty(P, D, dtype=torch.float32, device=p.device)
        _merge_bwd_kernel[(P,)](o1, lse1, w32, p, lse, dout.reshape(N, D).contiguous(), do1, dlse1, dp, part, N, D,
                                float(ctx.eps), ITERS=iters, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
                                num_warps=num_warps(BLOCK_M * BLOCK_D))
        o1_shape, lse1_shape, shape = ctx.shapes
        return (do1.view(o1_shape), dlse1.view(lse1_shape), part.sum(0).to(ctx.w_dtype), dp.view(shape), None)


def two_phase_fits(num_queries: int, D: int) -> bool:
    """Whether the fused phase 1 serves J queries of width D: its [J, D] accumulators per row in registers, at
    most 8192 elements padded (8 warps; 16384 on 16 warps spilled and did not pass its GPU test)."""
    return triton is not None and triton.next_power_of_2(num_queries) * triton.next_power_of_2(D) <= 8192


def attn_res_phase1_triton(queries: torch.Tensor, sealed: list[torch.Tensor], eps: float = EPS):
    """queries [J, D]; sealed: n tensors [..., D] of one shape. Returns (o1, lse1): J tensors [..., D] (fp32,
    each read over the sealed sources, normalised) and J tensors [...] (fp32 logsumexp of its logits)."""
    J, D = queries.shape
    if not two_phase_fits(J, D):
        raise ValueError(f"the fused phase 1 serves J·D ≤ 8192 (powers of two), got J={J}, D={D}")
    if any(s.shape != sealed[0].shape or s.shape[-1] != D for s in sealed):
        raise ValueError("phase-1 sources must share one shape [..., D]")
    out = _AttnResPhase1.apply(queries, eps, *sealed)
    return out[:J], out[J:]


def attn_res_merge_triton(o1: torch.Tensor, lse1: torch.Tensor, w: torch.Tensor, partial: torch.Tensor,
                          eps: float = EPS) -> torch.Tensor:
    """Phase 2 for one query: merge phase 1's (o1 [..., D], lse1 [...]) with the partial sum [..., D]; the result
    in the partial's dtype."""
    if o1.shape != partial.shape or lse1.shape != partial.shape[:-1]:
        raise ValueError(f"o1 {tuple(o1.shape)}, lse1 {tuple(lse1.shape)} and partial {tuple(partial.shape)} disagree")
    return _AttnResMerge.apply(o1, lse1, w, partial, eps)


def attn_res_read_triton(w: torch.Tensor, sources: list[torch.Tensor], eps: float = EPS) -> torch.Tensor:
    """w [D]; sources: n tensors [..., D] of one shape. Returns the read in the sources' dtype."""
    if len(sources) == 1:
        return sources[0]
    if any(s.shape != sources[0].shape for s in sources):
        raise ValueError("AttnRes sources must share one shape")
    return _AttnResRead.apply(w, eps, *sources)


def fused_attn_res_available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
