"""Grouped GEMMs in Triton: the two shapes of the routed experts, beside `torch._grouped_mm`.

Legend: M rows sorted by group (expert), G groups, `offs` [G] int32 cumulative group ends (offs[-1] = M).

- `grouped_mm(a [M, K], b [G, K, N], offs) -> [M, N]`: rows of group g times b[g] (forward and the
  backward's input gradients);
- `grouped_mm_wgrad(a [K, M], b [M, N], offs) -> [G, K, N]`: out[g] = a[:, s_g:e_g] @ b[s_g:e_g] (the
  weight gradients, a reduction over each group's rows).

Why a second implementation beside `torch._grouped_mm` (cuBLAS/CUTLASS on Hopper): the `small` preset's
experts are thin (L = 384, 2I = 640, I = 320), and `torch._grouped_mm` reached 339 TFLOP/s there against
~600 on K3's wide experts (docs/fast-paths.md). Its tile shapes are fixed by the library; here every launch
takes its tiles from `CONFIGS`, so 640 = 5 × 128 and 384 = 3 × 128 columns need no partial tiles, and the
benchmark (`benchmarks/grouped_gemm_triton.py`) times both on the same operands. The MoE runs the
weight-gradient kernel where it measured faster (`k3.ops.moe.GROUPED_WGRAD`; docs/fast-paths.md).

Scheduling without a host synchronisation: each group's rows are cut into `BM`-row tiles; a tile map
(group, first row) for at most ceil(M / BM) + G tiles is built on the device (`tile_map`), and the launch
covers that bound: programs past the last real tile return at once. The N tiles of one row tile are
neighbours in the launch order, so the row tile's A block is read from L2 by all but the first.

The references are the per-group loops `grouped_mm_reference` / `grouped_mm_wgrad_reference` (also the MoE's
CPU path); the interpreter tests tie both kernels to them in fp64, and on the GPU the MoE's expert test and
the benchmark's gate check them against `torch._grouped_mm` in bf16.
"""

from __future__ import annotations

import torch

from k3.ops import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the MoE uses its per-group loop
    triton = None

# Tiles and launch settings per kernel; `benchmarks/grouped_gemm_triton.py` times others beside these.
CONFIGS = {
    "rows": dict(BM=128, BN=128, BK=64, warps=8, stages=3),  # grouped_mm
    "wgrad": dict(BM=128, BN=128, BK=128, warps=8, stages=3),  # grouped_mm_wgrad (session 11 run 1's best)
}


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


def tile_map(offs: torch.Tensor, block_m: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(group, first row) of every BM-row tile, for ceil(rows / BM) + G slots; unused slots get group G.

    Built with device ops only (cumsum, searchsorted): no host synchronisation.
    """
    G = offs.shape[0]
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m
    last = tiles.cumsum(0)  # tiles of groups 0..g
    slot = torch.arange(triton.cdiv(rows, block_m) + G, device=offs.device)
    group = torch.searchsorted(last, slot, right=True)  # empty groups are skipped: their `last` repeats
    g = group.clamp(max=G - 1)
    first_row = starts[g] + (slot - (last[g] - tiles[g])) * block_m
    return group.to(torch.int32), first_row.to(torch.int32)


if triton is not None:

    @triton.jit
    def _dot(a, b, acc, PRECISION: tl.constexpr, INTERP: tl.constexpr):
        # the interpreter's bf16 dot is unusable: there bf16 operands are multiplied exactly in fp32
        if INTERP:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def _grouped_mm_kernel(A, B, C, TILE_GROUP, TILE_ROW, OFFS, G, N,
                           stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_cm, stride_cn,
                           K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           N_TILES: tl.constexpr, PRECISION: tl.constexpr, INTERP: tl.constexpr):
        """One [BM, BN] tile of C = A[rows of g] @ B[g]; the row tile is one slot of the tile map. K is a
        compile-time constant (the expert widths: a few specialisations), so the loop over it is static."""
        pid = tl.program_id(0)
        slot = pid // N_TILES
        g = tl.load(TILE_GROUP + slot)
        if g >= G:
            return
        row0 = tl.load(TILE_ROW + slot)
        end = tl.load(OFFS + g)
        rows = row0 + tl.arange(0, BM)
        cols = (pid % N_TILES) * BN + tl.arange(0, BN)
        in_rows = rows < end
        in_cols = cols < N
        ks = tl.arange(0, BK)
        a_ptr = A + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak
        b_ptr = B + g.to(tl.int64) * stride_bg + ks[:, None] * stride_bk + cols[None, :] * stride_bn
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            in_k = ks + k0 < K
            a = tl.load(a_ptr, mask=in_rows[:, None] & in_k[None, :], other=0.0)
            b = tl.load(b_ptr, mask=in_k[:, None] & in_cols[None, :], other=0.0)
            acc = _dot(a, b, acc, PRECISION, INTERP)
            a_ptr += BK * stride_ak
            b_ptr += BK * stride_bk
        c_ptr = C + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])

    @triton.jit
    def _wgrad_step(acc, A, B, r0, end, outs, cols, in_outs, in_cols, stride_ak, stride_am, stride_bm, stride_bn,
                    BK: tl.constexpr, PRECISION: tl.constexpr, INTERP: tl.constexpr):
        r = r0 + tl.arange(0, BK)
        in_r = r < end
        a = tl.load(A + outs.to(tl.int64)[:, None] * stride_ak + r.to(tl.int64)[None, :] * stride_am,
                    mask=in_outs[:, None] & in_r[None, :], other=0.0)
        b = tl.load(B + r.to(tl.int64)[:, None] * stride_bm + cols[None, :] * stride_bn,
                    mask=in_r[:, None] & in_cols[None, :], other=0.0)
        return _dot(a, b, acc, PRECISION, INTERP)

    @triton.jit
    def _grouped_mm_wgrad_kernel(A, B, C, OFFS, KO, N, stride_ak, stride_am, stride_bm, stride_bn,
                                 stride_cg, stride_ck, stride_cn,
                                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_TILES: tl.constexpr,
                                 N_TILES: tl.constexpr, PRECISION: tl.constexpr, INTERP: tl.constexpr):
        """One [BM, BN] tile of C[g] = A[:, s_g:e_g] @ B[s_g:e_g]: a loop over the group's rows."""
        pid = tl.program_id(0)
        g = pid // (K_TILES * N_TILES)
        tile = pid % (K_TILES * N_TILES)
        outs = (tile // N_TILES) * BM + tl.arange(0, BM)
        cols = (tile % N_TILES) * BN + tl.arange(0, BN)
        start = tl.load(OFFS + g - 1, mask=g > 0, other=0)
        end = tl.load(OFFS + g)
        in_outs = outs < KO
        in_cols = cols < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        # The interpreter cannot take a loaded scalar as a `range` bound; compiled code needs `for` to pipeline.
        if INTERP:
            r0 = start
            while r0 < end:
                acc = _wgrad_step(acc, A, B, r0, end, outs, cols, in_outs, in_cols, stride_ak, stride_am,
                                  stride_bm, stride_bn, BK, PRECISION, INTERP)
                r0 += BK
        else:
            for r0 in range(start, end, BK):
                acc = _wgrad_step(acc, A, B, r0, end, outs, cols, in_outs, in_cols, stride_ak, stride_am,
                                  stride_bm, stride_bn, BK, PRECISION, INTERP)
        c_ptr = C + g.to(tl.int64) * stride_cg + outs[:, None] * stride_ck + cols[None, :] * stride_cn
        tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=in_outs[:, None] & in_cols[None, :])


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


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """a [M, K] rows sorted by group, b [G, K, N] (any strides), offs [G] int32 ends -> [M, N] in a's dtype.

    config: tiles and launch settings (default CONFIGS["rows"])."""
    _check(a, b, offs, "grouped_mm")
    M, K = a.shape
    G, Kb, N = b.shape
    if Kb != K or offs.shape[0] != G:
        raise ValueError(f"grouped_mm: a {tuple(a.shape)}, b {tuple(b.shape)}, offs {tuple(offs.shape)} disagree")
    cfg = config or CONFIGS["rows"]
    c = a.new_empty(M, N)
    if M == 0:
        return c
    groups, first_rows = tile_map(offs, cfg["BM"], M)
    n_tiles = triton.cdiv(N, cfg["BN"])
    _grouped_mm_kernel[(groups.shape[0] * n_tiles,)](
        a, b, c, groups, first_rows, offs, G, N, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        b.stride(2), c.stride(0), c.stride(1), K=K, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], N_TILES=n_tiles,
        PRECISION=_precision(a.dtype), INTERP=interpreting(), num_warps=cfg["warps"], num_stages=cfg["stages"])
    return c


def grouped_mm_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                     config: dict | None = None) -> torch.Tensor:
    """a [K, M] (e.g. dyᵀ, any strides), b [M, N], offs [G] int32 ends -> [G, K, N] in a's dtype."""
    _check(a, b, offs, "grouped_mm_wgrad")
    KO, M = a.shape
    Mb, N = b.shape
    if Mb != M:
        raise ValueError(f"grouped_mm_wgrad: a {tuple(a.shape)} and b {tuple(b.shape)} disagree on rows")
    cfg = config or CONFIGS["wgrad"]
    G = offs.shape[0]
    c = a.new_empty(G, KO, N)
    k_tiles, n_tiles = triton.cdiv(KO, cfg["BM"]), triton.cdiv(N, cfg["BN"])
    _grouped_mm_wgrad_kernel[(G * k_tiles * n_tiles,)](
        a, b, c, offs, KO, N, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        c.stride(2), BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], K_TILES=k_tiles, N_TILES=n_tiles,
        PRECISION=_precision(a.dtype), INTERP=interpreting(), num_warps=cfg["warps"], num_stages=cfg["stages"])
    return c
