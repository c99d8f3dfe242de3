"""Fused RMSNorm and gated RMSNorm (Triton), beside the plain PyTorch reference.

Legend: N rows, D normalised width.

    rms_norm(x; w)              = w ⊙ x / sqrt(mean(x²) + ε)            (statistics in fp32)
    gated_rms_norm(x; w, g)     = rms_norm(x; w) ⊙ σ(g)                  (KDA's o_norm then output gate)

The reference (`naive_rms_norm`) runs ~6 elementwise kernels each way and saves fp32 copies for the
backward; the Triton kernels read x (and g) once, write y once, and save only the per-row 1/rms [N].
Backward: with x̂ = x·r, n = w ⊙ x̂ and upstream dn (= dy ⊙ σ(g) when gated),
dx = r·(w ⊙ dn − x̂·mean(w ⊙ dn ⊙ x̂)), dw = Σ_rows dn ⊙ x̂, dg = dy ⊙ n ⊙ σ(g)(1 − σ(g)).
The dw row sum is accumulated per program (a persistent grid) and the [programs, D] partials summed once.
"""

from __future__ import annotations

import torch

from k3.ops import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   gate: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The reference: fp32 statistics (fp64 for fp64), result cast to x's dtype (gate's when gated), or to
    `out_dtype` (ungated only)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.to(compute)
    if gate is None:
        return out.to(out_dtype or x.dtype)
    return (out * torch.sigmoid(gate.to(compute))).to(gate.dtype)


if triton is not None:

    @triton.jit
    def _strided_rows(rows, cols, inner, s0, s1):
        """Offsets of rows of a [N // inner, inner, D] view with strides (s0, s1, 1): a column slice
        of a wider tensor, split into heads, is read in place."""
        rows = rows.to(tl.int64)
        return ((rows // inner) * s0 + (rows % inner) * s1)[:, None] + cols[None, :]

    @triton.jit
    def _rms_fwd_kernel(X, W, G, Y, RSTD, N, D, eps, x_inner, x_s0, x_s1, g_inner, g_s0, g_s1,
                        HAS_GATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_D)
        mask = (rows[:, None] < N) & (cols[None, :] < D)
        offs = rows[:, None].to(tl.int64) * D + cols[None, :]
        x = tl.load(X + _strided_rows(rows, cols, x_inner, x_s0, x_s1), mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)  # [BLOCK_M]
        y = x * rstd[:, None] * w[None, :]
        if HAS_GATE:
            g = tl.load(G + _strided_rows(rows, cols, g_inner, g_s0, g_s1), mask=mask,
                        other=0.0).to(tl.float32)
            y = y * tl.sigmoid(g)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=rows < N)

    @triton.jit
    def _rms_bwd_kernel(X, W, G, DY, RSTD, DX, DG, DW_PART, N, D, x_inner, x_s0, x_s1, g_inner, g_s0,
                        g_s1, HAS_GATE: tl.constexpr, ITERS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_D], dtype=tl.float32)
        for it in range(ITERS):
            rows = (pid * ITERS + it) * BLOCK_M + tl.arange(0, BLOCK_M)
            mask = (rows[:, None] < N) & cmask[None, :]
            offs = rows[:, None].to(tl.int64) * D + cols[None, :]
            x = tl.load(X + _strided_rows(rows, cols, x_inner, x_s0, x_s1), mask=mask,
                        other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rows < N, other=0.0)
            xhat = x * rstd[:, None]
            if HAS_GATE:
                g = tl.load(G + _strided_rows(rows, cols, g_inner, g_s0, g_s1), mask=mask,
                            other=0.0).to(tl.float32)
                sg = tl.sigmoid(g)
                n = xhat * w[None, :]
                tl.store(DG + offs, (dy * n * sg * (1.0 - sg)).to(DG.dtype.element_ty), mask=mask)
                dy = dy * sg
            wdy = dy * w[None, :]
            c = tl.sum(wdy * xhat, axis=1) / D
            dx = (wdy - xhat * c[:, None]) * rstd[:, None]
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xhat, axis=0)
        tl.store(DW_PART + pid * D + cols, dw, mask=cmask)


def _blocks(D: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(D)
    return max(1, min(64, 4096 // block_d)), block_d


# The fused RMSNorm's launch (`benchmarks/norm.py` times the settings): rows of 512-1024 padded columns one per
# program on one warp in the forward, as the AttnRes reads (a row's sums stay inside the warp; at 4 warps a
# 768-wide row spans the four and each sum waits on a shared-memory barrier); narrower rows already lie one per
# warp in the tile form (`_blocks`, `num_warps`, 4 backward programs per SM). `one_warp_width` 0 turns it off. The
# interpreter keeps the tile form (it pays per program). The backward has its own rule (`measured_bwd`), from the
# kernels timed alone: at D = 768, 4 rows on 4 warps with 8 programs per SM beat one warp per row; at KDA's
# 128-wide gated heads one row per program on one warp with 32 per SM beat the tile form; other widths keep the
# tile form.
NORM_TILES: dict = {"block_m": None, "num_warps": None, "bwd_per_sm": None, "one_warp_width": 1024,
                    "measured_bwd": True}


def _norm_tiles(D: int, backward: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_D, warps, backward programs per SM) of the fused RMSNorm (`NORM_TILES`)."""
    block_m, block_d = _blocks(D)
    overridden = any(NORM_TILES[k] is not None for k in ("block_m", "num_warps", "bwd_per_sm"))
    if backward and NORM_TILES["measured_bwd"] and not overridden and not interpreting():
        if block_d <= 128:
            return 1, block_d, 1, 32
        if 512 <= block_d <= 1024:
            return 4, block_d, 4, 8
    if 256 < block_d <= NORM_TILES["one_warp_width"] and not interpreting():
        block_m, warps, per_sm = 1, 1, 16
    else:
        warps, per_sm = num_warps(block_m * block_d), 4
    block_m = NORM_TILES["block_m"] or block_m
    warps = NORM_TILES["num_warps"] or (warps if NORM_TILES["block_m"] is None else num_warps(block_m * block_d))
    return block_m, block_d, warps, NORM_TILES["bwd_per_sm"] or per_sm


def num_warps(block_elems: int) -> int:
    """Warps for a tile of this many fp32 elements (≤ 32 elements per thread and tensor)."""
    return max(4, min(16, block_elems // 1024))


def persistent_grid(N: int, block_m: int, device: torch.device, per_sm: int = 4) -> tuple[int, int]:
    """(programs, row blocks per program) for kernels that reduce over their rows (dw partials): about `per_sm`
    programs per multiprocessor.

    The blocks per program are a power of two and a compile-time constant: few specialisations, and a
    plain loop bound (the Triton interpreter cannot loop to a runtime scalar with NumPy 2).
    """
    n_blocks = triton.cdiv(N, block_m)
    cap = per_sm * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    iters = triton.next_power_of_2(triton.cdiv(n_blocks, max(1, min(n_blocks, cap))))
    return triton.cdiv(n_blocks, iters), iters


def _row_view(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """t [..., D] as the kernels' rows: (t, (inner, s0, s1)) when its rows form a [N // inner, inner, D] grid of
    unit column stride (a column slice of a wider projection, split into heads or not), else a contiguous copy."""
    D = t.shape[-1]
    if t.stride(-1) == 1:
        try:
            return t, (1, t.view(-1, D).stride(0), 0)
        except RuntimeError:  # the leading dims do not flatten to one row stride
            pass
        if t.dim() >= 3:
            try:
                return t, (t.shape[-2], t.view(-1, t.shape[-2], D).stride(0), t.stride(-2))
            except RuntimeError:
                pass
    return t.contiguous(), (1, D, 0)


def _kernel_rows(x, gate):
    """(x, gate or x, their six row-layout arguments) as the kernels take them (`_row_view`)."""
    x, x_rows = _row_view(x)
    gate, g_rows = _row_view(gate) if gate is not None else (x, x_rows)
    return x, gate, x_rows + g_rows


def rms_norm_forward_triton(x, weight, eps, gate=None, out_dtype=None):
    """x [..., D] (rows read in place where `_row_view` allows), weight [D], gate like x or None
    -> (y [N, D] contiguous, rstd [N] fp32)."""
    D = x.shape[-1]
    N = x.numel() // D
    gated = gate is not None
    x, gate, rows = _kernel_rows(x, gate)
    BLOCK_M, BLOCK_D, warps, _ = _norm_tiles(D)
    y = torch.empty(N, D, dtype=out_dtype or x.dtype, device=x.device)
    rstd = torch.empty(N, dtype=torch.float32, device=x.device)
    _rms_fwd_kernel[(triton.cdiv(N, BLOCK_M),)](x, weight, gate, y, rstd, N, D, float(eps), *rows,
                                                HAS_GATE=gated, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
                                                num_warps=warps)
    return y, rstd


def rms_norm_backward_triton(x, weight, rstd, dy2, gate=None):
    """x, gate as the forward took them, dy2 [N, D] contiguous. Returns (dx [N, D], dw [D] in weight's dtype,
    dg [N, D] or None)."""
    N, D = dy2.shape
    gated = gate is not None
    x, gate, rows = _kernel_rows(x, gate)
    BLOCK_M, BLOCK_D, warps, per_sm = _norm_tiles(D, backward=True)
    P, iters = persistent_grid(N, BLOCK_M, x.device, per_sm)
    dx = torch.empty(N, D, dtype=x.dtype, device=x.device)
    dg = torch.empty(N, D, dtype=gate.dtype, device=x.device) if gated else None
    part = torch.empty(P, D, dtype=torch.float32, device=x.device)
    _rms_bwd_kernel[(P,)](x, weight, gate, dy2, rstd, dx, dg if gated else dx, part, N, D, *rows,
                          HAS_GATE=gated, ITERS=iters, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, num_warps=warps)
    return dx, part.sum(0).to(weight.dtype), dg


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps, out_dtype):
        # x and the gate are read in place: KDA's gate is a column slice of its fused projections, split into heads;
        # a layout the kernels cannot read is copied here once, and the copy saved for the backward
        x = _row_view(x)[0]
        gate = _row_view(gate)[0] if gate is not None else None
        y, rstd = rms_norm_forward_triton(x, weight, eps, gate, gate.dtype if gate is not None else out_dtype)
        ctx.save_for_backward(x, weight, rstd, gate)
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, rstd, gate = ctx.saved_tensors
        dx, dw, dg = rms_norm_backward_triton(x, weight, rstd, dy.reshape(-1, x.shape[-1]).contiguous(), gate)
        return dx.view(x.shape), dw, (dg.view(x.shape) if dg is not None else None), None, None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None):
    """Fused (gated) RMSNorm, same contract as `naive_rms_norm` with a weight; x [..., D], gate like x."""
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if gate is not None and out_dtype is not None:
        raise ValueError("a gated norm returns the gate's dtype; out_dtype is for the ungated norm")
    return _RMSNorm.apply(x, weight, gate, eps, out_dtype or x.dtype)


def fused_norm_available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
