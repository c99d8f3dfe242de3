"""The weight-gradient grouped GEMM of the routed experts in Triton, beside `torch._grouped_mm`.

Legend: M rows sorted by group (expert), G groups, `offs` [G] int32 cumulative group ends (offs[-1] = M).

`grouped_mm_wgrad(a [K, M], b [M, N], offs) -> [G, K, N]`: out[g] = a[:, s_g:e_g] @ b[s_g:e_g], one program per
output tile and group, looping over the group's rows. Why beside `torch._grouped_mm`: on the `small` preset's
thin experts (L = 384, 2I = 640, I = 320) torch's weight-gradient GEMM slows with the largest group under skewed
routing, and this kernel measured faster there (docs/fast-paths.md); the MoE runs it where it measured faster
(`k3.ops.moe.GROUPED_WGRAD`). A row-form kernel for the forward and data gradients was slower than torch and was
deleted.

The references are the per-group loops `grouped_mm_reference` / `grouped_mm_wgrad_reference` (the MoE's CPU
path); the interpreter tests tie the kernel to them in fp64, and on the GPU the MoE's expert test and the
benchmark's gate (`benchmarks/grouped_gemm_triton.py`) check it against `torch._grouped_mm` in bf16.
"""

from __future__ import annotations

import torch

from k3.ops import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the MoE uses its per-group loop
    triton = None

# Tiles and launch settings, the best `benchmarks/grouped_gemm_triton.py` timed; it times others.
WGRAD_CONFIG = dict(BM=128, BN=128, BK=128, warps=8, stages=3)


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group loop of matmuls (reads offs on the host)."""
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        torch.mm(a[start:end], b[g], out=out[start:end])
        start = end
    return out


def grouped_mm_wgrad_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group loop of matmuls over the shared token dimension (reads offs on the host)."""
    out = a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        torch.mm(a[:, start:end], b[start:end], out=out[g])
        start = end
    return out


if triton is not None:

    @triton.jit
    def _dot(a, b, acc, PRECISION: tl.constexpr, INTERP: tl.constexpr):
        # the interpreter's bf16 dot is unusable: there bf16 operands are multiplied exactly in fp32
        if INTERP:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def _wgrad_step(acc, A, B, r0, end, out_rows, cols, in_out_rows, in_cols, stride_ak, stride_am, stride_bm,
                    stride_bn, BK: tl.constexpr, PRECISION: tl.constexpr, INTERP: tl.constexpr):
        r = r0 + tl.arange(0, BK)
        in_r = r < end
        a = tl.load(A + out_rows.to(tl.int64)[:, None] * stride_ak + r.to(tl.int64)[None, :] * stride_am,
                    mask=in_out_rows[:, None] & in_r[None, :], other=0.0)
        b = tl.load(B + r.to(tl.int64)[:, None] * stride_bm + cols[None, :] * stride_bn,
                    mask=in_r[:, None] & in_cols[None, :], other=0.0)
        return _dot(a, b, acc, PRECISION, INTERP)

    @triton.jit
    def _grouped_mm_wgrad_kernel(A, B, C, C2, OFFS, KO, N, SPLIT, stride_ak, stride_am, stride_bm, stride_bn,
                                 stride_cg, stride_ck, stride_cn,
                                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_TILES: tl.constexpr,
                                 N_TILES: tl.constexpr, PRECISION: tl.constexpr, INTERP: tl.constexpr,
                                 TWO_OUTPUTS: tl.constexpr, ACCUMULATE: tl.constexpr):
        """One [BM, BN] tile of C[g] = A[:, s_g:e_g] @ B[s_g:e_g]: a loop over the group's rows. With TWO_OUTPUTS
        the output rows from SPLIT on land in C2 (rows minus SPLIT; the same strides), e.g. w1's and w3's
        gradients from one [w1; w3] product; with ACCUMULATE the tile is added to what C holds (in fp32)."""
        pid = tl.program_id(0)
        g = pid // (K_TILES * N_TILES)
        tile = pid % (K_TILES * N_TILES)
        out_rows = (tile // N_TILES) * BM + tl.arange(0, BM)
        cols = (tile % N_TILES) * BN + tl.arange(0, BN)
        start = tl.load(OFFS + g - 1, mask=g > 0, other=0)
        end = tl.load(OFFS + g)
        in_out_rows = out_rows < KO
        in_cols = cols < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        # The interpreter cannot take a loaded scalar as a `range` bound; compiled code needs `for` to pipeline.
        if INTERP:
            r0 = start
            while r0 < end:
                acc = _wgrad_step(acc, A, B, r0, end, out_rows, cols, in_out_rows, in_cols, stride_ak, stride_am,
                                  stride_bm, stride_bn, BK, PRECISION, INTERP)
                r0 += BK
        else:
            for r0 in range(start, end, BK):
                acc = _wgrad_step(acc, A, B, r0, end, out_rows, cols, in_out_rows, in_cols, stride_ak, stride_am,
                                  stride_bm, stride_bn, BK, PRECISION, INTERP)
        dest_rows = out_rows
        if TWO_OUTPUTS:
            dest_rows = tl.where(out_rows < SPLIT, out_rows, out_rows - SPLIT)
        offsets = g.to(tl.int64) * stride_cg + dest_rows[:, None] * stride_ck + cols[None, :] * stride_cn
        c_ptr = C + offsets
        if TWO_OUTPUTS:
            c_ptr = tl.where(out_rows[:, None] < SPLIT, c_ptr, C2 + offsets)
        mask = in_out_rows[:, None] & in_cols[None, :]
        if ACCUMULATE:
            acc += tl.load(c_ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands multiply in full fp32 (the tests' exactness); bf16/fp16 take the tensor cores either way
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, what: str):
    if a.dtype != b.dtype:
        raise ValueError(f"{what}: operands must share a dtype, got {a.dtype} and {b.dtype}")
    if a.dtype == torch.float64:
        raise ValueError(f"{what}: Triton has no fp64 tensor-core dot; use the reference loop")
    if offs.dtype != torch.int32 or offs.dim() != 1:
        raise ValueError(f"{what}: offs must be a 1-D int32 tensor of cumulative group ends")


def grouped_mm_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                     config: dict | None = None) -> torch.Tensor:
    """a [K, M] (e.g. dyᵀ, any strides), b [M, N], offs [G] int32 ends -> [G, K, N] in a's dtype.

    config: tiles and launch settings (default WGRAD_CONFIG)."""
    _check(a, b, offs, "grouped_mm_wgrad")
    KO, M = a.shape
    Mb, N = b.shape
    if Mb != M:
        raise ValueError(f"grouped_mm_wgrad: a {tuple(a.shape)} and b {tuple(b.shape)} disagree on rows")
    c = a.new_empty(offs.shape[0], KO, N)
    _launch_wgrad(a, b, offs, [c], False, config)
    return c


def grouped_mm_wgrad_into(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, outs: list[torch.Tensor],
                          accumulate: bool, config: dict | None = None) -> None:
    """`grouped_mm_wgrad(a, b, offs)` written into `outs` (one or two [G, K_i, N] tensors of one dtype and
    strides, Σ K_i = K: the product's rows split between them), added to what they hold if `accumulate`; the
    product in fp32 either way (so fp32 `outs` take 16-bit operands' products unrounded). For weight gradients
    accumulated in place (`k3.ops.weight_grads`)."""
    _check(a, b, offs, "grouped_mm_wgrad_into")
    if not 1 <= len(outs) <= 2:
        raise ValueError(f"grouped_mm_wgrad_into: one or two outputs, got {len(outs)}")
    G, (KO, M), N = offs.shape[0], a.shape, b.shape[1]
    if b.shape[0] != M:
        raise ValueError(f"grouped_mm_wgrad_into: a {tuple(a.shape)} and b {tuple(b.shape)} disagree on rows")
    first = outs[0]
    for out in outs:
        if out.dim() != 3 or out.shape[0] != G or out.shape[2] != N or out.dtype != first.dtype \
                or out.stride() != first.stride() or out.device != a.device:
            raise ValueError(f"grouped_mm_wgrad_into: outputs must be [{G}, K_i, {N}] of one dtype and strides "
                             f"on {a.device}, got {[(tuple(o.shape), o.dtype, o.stride()) for o in outs]}")
    if sum(out.shape[1] for out in outs) != KO:
        raise ValueError(f"grouped_mm_wgrad_into: the outputs' rows {[o.shape[1] for o in outs]} must sum to {KO}")
    _launch_wgrad(a, b, offs, outs, accumulate, config)


def _launch_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, outs: list[torch.Tensor], accumulate: bool,
                  config: dict | None) -> None:
    """One launch of `_grouped_mm_wgrad_kernel` over every (group, output tile); outputs checked by the caller."""
    cfg = config or WGRAD_CONFIG
    (KO, _), N, c = a.shape, b.shape[1], outs[0]
    k_tiles, n_tiles = triton.cdiv(KO, cfg["BM"]), triton.cdiv(N, cfg["BN"])
    _grouped_mm_wgrad_kernel[(offs.shape[0] * k_tiles * n_tiles,)](
        a, b, c, outs[-1], offs, KO, N, c.shape[1], a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        c.stride(0), c.stride(1), c.stride(2), BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], K_TILES=k_tiles,
        N_TILES=n_tiles, PRECISION=_precision(a.dtype), INTERP=interpreting(), TWO_OUTPUTS=len(outs) == 2,
        ACCUMULATE=accumulate, num_warps=cfg["warps"], num_stages=cfg["stages"])
