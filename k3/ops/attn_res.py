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
"""

from __future__ import annotations

import torch

from k3.ops.norm import num_warps, persistent_grid

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

EPS = 1e-5


if triton is not None:

    @triton.jit
    def _ar_fwd_kernel(srcs, W, OUT, LSE, N, D, eps, NS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_D)
        mask = (rows[:, None] < N) & (cols[None, :] < D)
        offs = rows[:, None].to(tl.int64) * D + cols[None, :]
        w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(NS):
            v = tl.load(srcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
            s = tl.sum(v * w[None, :], axis=1) * r
            m_new = tl.maximum(m, s)
            scale = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            acc = acc * scale[:, None] + p[:, None] * v
            l = l * scale + p
            m = m_new
        tl.store(OUT + offs, (acc / l[:, None]).to(OUT.dtype.element_ty), mask=mask)
        tl.store(LSE + rows, m + tl.log(l), mask=rows < N)

    @triton.jit
    def _ar_bwd_kernel(srcs, dsrcs, W, DOUT, LSE, DW_PART, N, D, eps, NS: tl.constexpr, NS_PAD: tl.constexpr,
                       ITERS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        src_id = tl.arange(0, NS_PAD)
        dw = tl.zeros([BLOCK_D], dtype=tl.float32)
        for it in range(ITERS):
            rows = (pid * ITERS + it) * BLOCK_M + tl.arange(0, BLOCK_M)
            rmask = rows < N
            mask = rmask[:, None] & cmask[None, :]
            offs = rows[:, None].to(tl.int64) * D + cols[None, :]
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
                r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
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
                tl.store(dsrcs[i] + offs, dv.to(dsrcs[i].dtype.element_ty), mask=mask)
                dw += tl.sum((ds * r)[:, None] * v, axis=0)
        tl.store(DW_PART + pid * D + cols, dw, mask=cmask)


def _blocks(D: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(D)
    return max(1, min(16, 2048 // block_d)), block_d


class _AttnResRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, eps, *sources):
        shape = sources[0].shape
        D = shape[-1]
        flat = tuple(s.reshape(-1, D).contiguous() for s in sources)
        N = flat[0].shape[0]
        BLOCK_M, BLOCK_D = _blocks(D)
        out = torch.empty(N, D, dtype=sources[0].dtype, device=w.device)
        lse = torch.empty(N, dtype=torch.float32, device=w.device)
        w32 = w.float().contiguous()
        _ar_fwd_kernel[(triton.cdiv(N, BLOCK_M),)](flat, w32, out, lse, N, D, float(eps), NS=len(flat),
                                                   BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
                                                   num_warps=num_warps(BLOCK_M * BLOCK_D))
        ctx.save_for_backward(w32, lse, *flat)
        ctx.shape, ctx.eps, ctx.w_dtype = shape, eps, w.dtype
        return out.view(shape)

    @staticmethod
    def backward(ctx, dout):
        w32, lse, *flat = ctx.saved_tensors
        N, D = flat[0].shape
        BLOCK_M, BLOCK_D = _blocks(D)
        P, iters = persistent_grid(N, BLOCK_M, w32.device)
        dsrcs = tuple(torch.empty_like(s) for s in flat)
        part = torch.empty(P, D, dtype=torch.float32, device=w32.device)
        _ar_bwd_kernel[(P,)](tuple(flat), dsrcs, w32, dout.reshape(N, D).contiguous(), lse, part, N, D,
                             float(ctx.eps), NS=len(flat), NS_PAD=triton.next_power_of_2(len(flat)), ITERS=iters,
                             BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, num_warps=num_warps(BLOCK_M * BLOCK_D))
        dw = part.sum(0).to(ctx.w_dtype)
        return (dw, None, *(d.view(ctx.shape) for d in dsrcs))


def attn_res_read_triton(w: torch.Tensor, sources: list[torch.Tensor], eps: float = EPS) -> torch.Tensor:
    """w [D]; sources: n tensors [..., D] of one shape. Returns the read in the sources' dtype."""
    if len(sources) == 1:
        return sources[0]
    if any(s.shape != sources[0].shape for s in sources):
        raise ValueError("AttnRes sources must share one shape")
    return _AttnResRead.apply(w, eps, *sources)


def fused_attn_res_available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
