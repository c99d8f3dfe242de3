"""Session 21 probe: a persistent Triton grouped GEMM for the routed experts' row GEMMs (x @ W_gᵀ per group),
TMA tensor descriptors, with and without Triton's warp specialisation, against torch._grouped_mm and the dense
cuBLAS matmul of the same shapes. Issue 9's 600 TFLOP/s goal on the small and K3 expert shapes.

    python benchmarks/sessions/s21_grouped_rows_probe.py            # one H200
    TRITON_INTERPRET=1 python benchmarks/sessions/s21_grouped_rows_probe.py --quick   # CPU: correctness only

Run 1 (session 21) had the tile's body written out inside the persistent loop; it is `_rows_tile` now (Triton
inlines it: the same kernel).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _rows_tile(a_desc, b_desc, C, TILE_GROUP, TILE_ROW0, TILE_END, tile, N, K: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_TILES: tl.constexpr):
    mt = tile // N_TILES
    nt = tile % N_TILES
    g = tl.load(TILE_GROUP + mt)
    row0 = tl.load(TILE_ROW0 + mt)
    end = tl.load(TILE_END + mt)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = a_desc.load([row0, k0])
        b = b_desc.load([g * N + nt * BN, k0])
        acc = tl.dot(a, b.T, acc)
    rows = row0 + tl.arange(0, BM)
    cols = nt * BN + tl.arange(0, BN)
    mask = (rows < end)[:, None] & (cols < N)[None, :]
    tl.store(C + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _rows_persistent(A, B, C, TILE_GROUP, TILE_ROW0, TILE_END, TOTAL, M, N, K: tl.constexpr, G, NUM_PROGRAMS,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_TILES: tl.constexpr,
                     WS: tl.constexpr, INTERP: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(B, shape=[G * N, K], strides=[K, 1], block_shape=[BN, BK])
    total = tl.load(TOTAL) * N_TILES
    if INTERP:  # the interpreter cannot take a loaded scalar as a range bound
        tile = tl.program_id(0)
        while tile < total:
            _rows_tile(a_desc, b_desc, C, TILE_GROUP, TILE_ROW0, TILE_END, tile, N, K, BM, BN, BK, N_TILES)
            tile += NUM_PROGRAMS
    else:
        for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS, warp_specialize=WS):
            _rows_tile(a_desc, b_desc, C, TILE_GROUP, TILE_ROW0, TILE_END, tile, N, K, BM, BN, BK, N_TILES)


@triton.jit
def _rows_grid(A, B, C, TILE_GROUP, TILE_ROW0, TILE_END, TOTAL, M, N, K: tl.constexpr, G,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_TILES: tl.constexpr):
    tile = tl.program_id(0)
    if tile < tl.load(TOTAL) * N_TILES:
        a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(B, shape=[G * N, K], strides=[K, 1], block_shape=[BN, BK])
        _rows_tile(a_desc, b_desc, C, TILE_GROUP, TILE_ROW0, TILE_END, tile, N, K, BM, BN, BK, N_TILES)


def tile_map(offs: torch.Tensor, BM: int, M: int):
    """offs [G] int32 group ends -> per m-tile (group, first row, group end) [upper], and the count [1]."""
    G = offs.shape[0]
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    n = (ends - starts + BM - 1) // BM
    cum = n.cumsum(0)
    upper = (M + BM - 1) // BM + G
    t = torch.arange(upper, device=offs.device)
    g = torch.searchsorted(cum, t, right=True).clamp_max(G - 1)
    row0 = starts[g] + (t - (cum - n)[g]) * BM
    return g.int(), row0.int(), ends[g].int(), cum[-1:].int(), upper


def grouped_rows(a, b, offs, cfg, persistent=True, ws=False, tmap=None, programs=None):
    """a [M, K] rows grouped by offs; b [G, N, K] -> [M, N] = a_g @ b_gᵀ per group."""
    M, K = a.shape
    G, N, _ = b.shape
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    tg, tr, te, total, upper = tmap if tmap is not None else tile_map(offs, BM, M)
    c = a.new_empty(M, N)
    n_tiles = triton.cdiv(N, BN)
    if persistent:
        P = programs or torch.cuda.get_device_properties(a.device).multi_processor_count
        _rows_persistent[(P,)](a, b, c, tg, tr, te, total, M, N, K, G, P, BM=BM, BN=BN, BK=BK, N_TILES=n_tiles,
                               WS=ws, INTERP=not a.is_cuda, num_warps=cfg["warps"], num_stages=cfg["stages"])
    else:
        _rows_grid[(upper * n_tiles,)](a, b, c, tg, tr, te, total, M, N, K, G, BM=BM, BN=BN, BK=BK,
                                       N_TILES=n_tiles, num_warps=cfg["warps"], num_stages=cfg["stages"])
    return c


def reference(a, b, offs):
    out = a.new_zeros(a.shape[0], b.shape[1])
    s = 0
    for g, e in enumerate(offs.tolist()):
        out[s:e] = a[s:e] @ b[g].t()
        s = e
    return out


def routed_offsets(tokens, k, E, skew, gen, device, align=8):
    from benchmarks.moe_grouped_gemm import zipf_routes
    from k3.ops.moe import dispatch_plan
    idx = zipf_routes(tokens, k, E, skew, gen, device)
    _, offs, rows = dispatch_plan(idx, E, align)
    loads = torch.bincount(idx.reshape(-1).cpu(), minlength=E).float()
    return offs, rows, (loads.max() / loads.mean()).item()


CONFIGS = [dict(BM=128, BN=128, BK=64, warps=4, stages=4), dict(BM=128, BN=128, BK=128, warps=4, stages=3),
           dict(BM=128, BN=128, BK=64, warps=8, stages=4), dict(BM=128, BN=256, BK=64, warps=8, stages=3),
           dict(BM=128, BN=256, BK=64, warps=8, stages=4), dict(BM=64, BN=128, BK=128, warps=4, stages=4),
           dict(BM=128, BN=64, BK=128, warps=4, stages=4), dict(BM=256, BN=128, BK=64, warps=8, stages=3)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    gen = torch.Generator().manual_seed(0)
    if args.quick:
        # rows past a group's end inside a tile, groups of 0 rows, K not a multiple of BK, N not of BN
        offs = torch.tensor([5, 5, 40, 41, 100], dtype=torch.int32)
        a = torch.randn(100, 48, generator=gen)
        b = torch.randn(5, 40, 48, generator=gen)
        ref = reference(a.double(), b.double(), offs)
        cfg = dict(BM=16, BN=16, BK=32, warps=4, stages=1)
        for persistent in (True, False):
            out = grouped_rows(a, b, offs, cfg, persistent=persistent, programs=3)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            print(f"quick persistent={persistent}: rel err {err:.2e}")
            assert err < 1e-2, err
        return
    from triton.testing import do_bench
    results = []
    peak_a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = do_bench(lambda: peak_a @ peak_a, warmup=25, rep=200)
    peak = 2 * 8192 ** 3 / t / 1e9
    print(f"dense 8192^3 bf16: {peak:.1f} TFLOP/s", flush=True)
    # name, E, L, I, tokens, k, skew
    cases = [("small 16K zipf", 64, 384, 320, 16384, 8, 0.7), ("small 64K zipf", 64, 384, 320, 65536, 8, 0.7),
             ("small 64K bal", 64, 384, 320, 65536, 8, 0.0), ("k3-32 2K zipf", 32, 3584, 3072, 2048, 16, 0.7),
             ("k3-128 8K zipf", 128, 3584, 3072, 8192, 16, 0.7)]
    for name, E, L, I, tokens, k, skew in cases:
        offs, rows, imb = routed_offsets(tokens, k, E, skew, gen, device)
        routed = tokens * k
        for gemm, Kd, Nd in (("up", L, 2 * I), ("down", I, L)):
            a = (torch.randn(rows, Kd, generator=gen) * 0.5).to(device, torch.bfloat16)
            b = (torch.randn(E, Nd, Kd, generator=gen) * Kd ** -0.5).to(device, torch.bfloat16)
            flops = 2 * routed * Kd * Nd
            ref = torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
            t_torch = do_bench(lambda: torch._grouped_mm(a, b.transpose(1, 2), offs=offs), warmup=25, rep=200)
            w0 = b[0].t()
            t_dense = do_bench(lambda: a @ w0, warmup=25, rep=200)
            row = dict(case=name, gemm=gemm, M=rows, K=Kd, N=Nd, imbalance=imb,
                       torch_ms=t_torch, torch_tf=flops / t_torch / 1e9, dense_tf=2 * rows * Kd * Nd / t_dense / 1e9)
            print(f"{name} {gemm} M={rows} K={Kd} N={Nd} imb={imb:.2f}: torch {t_torch*1e3:.1f} us "
                  f"{row['torch_tf']:.0f} TF/s; dense cuBLAS (all rows) {row['dense_tf']:.0f} TF/s", flush=True)
            best = None
            for cfg in CONFIGS:
                tmap = tile_map(offs, cfg["BM"], rows)
                for mode in ("grid", "persistent", "persistent+ws"):
                    label = f"{cfg['BM']}x{cfg['BN']}x{cfg['BK']} w{cfg['warps']} s{cfg['stages']} {mode}"
                    try:
                        fn = lambda: grouped_rows(a, b, offs, cfg, persistent=mode != "grid",  # noqa: E731
                                                  ws=mode.endswith("ws"), tmap=tmap)
                        out = fn()
                        torch.cuda.synchronize()
                        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                        if not err < 1e-2:
                            print(f"   {label}: WRONG rel err {err:.2e}", flush=True)
                            continue
                        t = do_bench(fn, warmup=25, rep=200)
                    except Exception as e:  # noqa: BLE001
                        print(f"   {label}: failed {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                        continue
                    tf = flops / t / 1e9
                    print(f"   {label}: {t*1e3:.1f} us {tf:.0f} TF/s ({t_torch / t:.2f}x torch)", flush=True)
                    results.append(dict(row, config=label, ms=t, tf=tf, ratio=t_torch / t))
                    if best is None or t < best[1]:
                        best = (label, t)
            if best:
                print(f"  BEST {name} {gemm}: {best[0]} {flops / best[1] / 1e9:.0f} TF/s vs torch "
                      f"{row['torch_tf']:.0f} ({t_torch / best[1]:.2f}x)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(peak=peak, results=results), f, indent=1)


if __name__ == "__main__":
    main()
