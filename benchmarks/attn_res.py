"""Block AttnRes on one GPU: the reads of one block in the fused two-phase form (one phase 1 over the sealed
sources for all J queries, then J merges) against the fused direct read (one read over every source per
query), side by side on the same inputs, forward and forward+backward.

Legend: n sealed sources, J reads per block, N rows (tokens), D model width.

Shapes: the small preset at 32K tokens per step (N = 32768, D = 768, J = 7 reads: its last block's 6 plus the
output read, the most any block makes), n = 1, 4 and 7 sealed sources; fp32 sources and partial sums, as in the
model. Times: median of `triton.testing.do_bench` (ms). Forward+backward includes the
autograd engine's sums of the direct read's per-read source gradients, which the two-phase form does not make.
A gate (both against the torch two-phase form in fp64, ≤ 1e-5) runs first.

    python -m benchmarks.attn_res            # one GPU
    python -m benchmarks.attn_res --quick    # small shapes, gate only (CPU: through the Triton interpreter)
    python -m benchmarks.attn_res --tiles    # the direct read's launch settings (k3.ops.attn_res.READ_TILES)

`--tiles` times the fused direct read as the model runs it: bf16 sources, N = 65536 (the small
preset at 64K tokens per micro-batch), the sealed sources `seal_source`d and read by two reads (the second read's
backward adds into the first's buffers), under each (rows per tile, warps, backward programs per SM), after a
check that each setting gives the default's outputs and gradients (≤ 1e-2 relative: bf16 results, the settings
change only the order of sums).

On a GPU the default run writes table "two-phase" and --tiles table "tiles" of
benchmarks/results/attn-res-<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from k3.model.attn_res import block_reads  # noqa: E402
from k3.ops.attn_res import attn_res_read_triton, seal_source  # noqa: E402

from benchmarks.provenance import save_result, table  # noqa: E402

CLAIM = ("The fused Block AttnRes read: its launch settings (rows per program, warps, backward programs per SM) at "
         "the small preset's 64K-token micro-batch, and the direct read against the fused two-phase form")


def block_inputs(n, J, N, D, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    sealed = [torch.randn(1, N, D, device=device, generator=g) * (1 + i) for i in range(n)]  # [B=1, T=N, D]
    partials = [torch.randn(1, N, D, device=device, generator=g) * 2 for _ in range(J)]
    queries = torch.randn(J, D, device=device, generator=g) * 0.05
    douts = [torch.randn(1, N, D, device=device, generator=g) for _ in range(J)]
    return sealed, partials, queries, douts


def direct_block(sealed, partials, queries):
    """Read j over sealed + [partial j] (the first read of a block has no partial: the sealed sources alone)."""
    return [attn_res_read_triton(queries[j], sealed + ([partials[j]] if j else [])) for j in range(len(partials))]


def two_phase_block(sealed, partials, queries, fused=True):
    """The same reads as the model's two-phase wiring makes them (`block_reads`; fused False: the torch form)."""
    read = block_reads(queries, sealed, fused)
    return [read(j, queries[j], partials[j] if j else None) for j in range(len(partials))]


def reference_block(sealed, partials, queries):
    return two_phase_block(sealed, partials, queries, fused=False)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_with_grads(fn, sealed, partials, queries, douts, dtype):
    leaves = [[t.detach().to(dtype).requires_grad_() for t in ts] for ts in (sealed, partials)]
    q = queries.detach().to(dtype).requires_grad_()
    outs = fn(*leaves, q)
    torch.autograd.backward(outs, [d.to(o.dtype) for o, d in zip(outs, douts)])
    return outs, [t.grad for t in leaves[0] + leaves[1][1:]] + [q.grad]


def gate(device, n=4, J=7, N=300, D=96):
    inputs = block_inputs(n, J, N, D, device, seed=1)
    ref_out, ref_grads = run_with_grads(reference_block, *inputs, torch.float64)
    errs = {}
    for name, fn in (("direct", direct_block), ("two-phase", two_phase_block)):
        out, grads = run_with_grads(fn, *inputs, torch.float32)
        errs[name] = max([rel(a, b) for a, b in zip(out, ref_out)] + [rel(a, b) for a, b in zip(grads, ref_grads)])
    return errs, all(e <= 1e-5 for e in errs.values())


TILE_SETTINGS = [  # (rows per tile, warps, backward programs per SM); None: the default's (one row on one warp at
    # D = 768, 16 backward programs per SM). The settings timed before and dropped: docs/fast-paths.md, "Block AttnRes"
    (None, None, None), (None, None, 8), (None, None, 32), (2, 4, None)]


def read_pair(sealed, partial, queries):
    """Two reads over the same sealed sources, as two layers of one block read them."""
    sealed = [seal_source(s) for s in sealed]
    return [attn_res_read_triton(queries[0], sealed + [partial]), attn_res_read_triton(queries[1], sealed)]


def tiles(device, N=65536, D=768, dtype=torch.bfloat16) -> int:
    from triton.testing import do_bench

    from k3.ops import attn_res

    default = dict(attn_res.READ_TILES)
    print(f"fused direct read, N={N} D={D} {dtype}: two reads per sealed set (ms, median; bytes at the minimum "
          "traffic: forward reads every source once and writes the output, backward reads every source twice, "
          "dout once, a sink buffer once where it accumulates, and writes every gradient)")
    rows = []
    for n in (3, 7):
        sealed, partials, queries, douts = block_inputs(n, 2, N, D, device, seed=n)
        sealed = [s.to(dtype) for s in sealed]
        partial, douts = partials[0].to(dtype), [d.to(dtype) for d in douts]
        ref = None
        for setting in TILE_SETTINGS:
            attn_res.READ_TILES.update(block_m=setting[0], num_warps=setting[1], bwd_per_sm=setting[2])
            leaves = [t.clone().requires_grad_() for t in sealed + [partial]] + [queries.clone().requires_grad_()]

            def step(leaves=leaves):
                outs = read_pair(leaves[:n], leaves[n], leaves[-1])
                torch.autograd.backward(outs, douts)
                return outs

            try:
                outs = [o.detach().float().clone() for o in step()] + [t.grad.float().clone() for t in leaves]
            except Exception as e:  # a setting Triton cannot build: reported, not fatal
                print(f"  n={n} {setting}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            if ref is None:
                ref = outs
            diff = max(rel(a, b) for a, b in zip(outs, ref))
            with torch.no_grad():
                fwd = do_bench(lambda: read_pair(sealed, partial, queries), warmup=5, rep=40)
            both = do_bench(step, warmup=5, rep=40, grad_to_none=leaves)
            fwd_bytes = (2 * n + 2) * N * D * 2
            bwd_bytes = (2 * (2 * n + 1) + 2 + (n - 1) + (2 * n + 1)) * N * D * 2
            rows.append((n, setting, fwd, both - fwd, fwd_bytes / fwd / 1e6, bwd_bytes / (both - fwd) / 1e6, diff))
            print(f"  n={n} {str(setting):24s} fwd {fwd:.3f} ms ({rows[-1][4]:.0f} GB/s)  bwd {both - fwd:.3f} ms "
                  f"({rows[-1][5]:.0f} GB/s)  diff {diff:.1e}", flush=True)
    attn_res.READ_TILES.update(default)
    print(f"{'sealed':>6} {'(rows, warps, bwd/SM)':>30} {'fwd ms':>8} {'bwd ms':>8} {'fwd GB/s':>9} "
          f"{'bwd GB/s':>9} "
          f"{'diff':>8}")
    for n, setting, f, b, fb, bb, d in rows:
        print(f"{n:>6} {str(setting):>30} {f:8.3f} {b:8.3f} {fb:9.0f} {bb:9.0f} {d:8.1e}")
    bad = [r for r in rows if not r[-1] <= 1e-2]  # bf16 outputs: the settings change only the order of sums
    save_result("attn-res", CLAIM, {"tiles": table(
        ["sealed sources", "(rows, warps, bwd per SM)", "fwd ms", "bwd ms", "fwd GB/s", "bwd GB/s", "diff vs first"],
        [[n, str(setting), round(f, 3), round(b, 3), round(fb), round(bb), f"{d:.1e}"]
         for n, setting, f, b, fb, bb, d in rows],
        note=f"N = {N:,}, D = {D}, {str(dtype).removeprefix('torch.')}, two reads per sealed set; None: "
             "`READ_TILES`' default.")})
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiles", action="store_true", help="time the direct read's launch settings")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiles and device == "cuda":
        return tiles(device)
    errs, ok = gate(device)
    print("correctness gate (fp32 vs the fp64 two-phase form):", {k: f"{v:.1e}" for k, v in errs.items()},
          "ok" if ok else "FAILED")
    if not ok:
        return 1
    if args.quick or device != "cuda":
        return 0
    from triton.testing import do_bench

    N, D, J = 32768, 768, 7
    print(f"AttnRes reads of one block, N={N} D={D} J={J} fp32 (ms; ratio = direct / two-phase)")
    print(f"{'sealed':>6}  {'direct fwd':>10}  {'2-phase fwd':>11}  {'ratio':>5}  {'direct f+b':>10}  "
          f"{'2-phase f+b':>11}  {'ratio':>5}")
    rows = []
    for n in (1, 4, 7):
        sealed, partials, queries, douts = block_inputs(n, J, N, D, device)
        times = {}
        for name, fn in (("direct", direct_block), ("two-phase", two_phase_block)):
            with torch.no_grad():
                fwd = do_bench(lambda: fn(sealed, partials, queries), warmup=5, rep=50)
            leaves = [t.clone().requires_grad_() for t in sealed + partials] + [queries.clone().requires_grad_()]

            def step(fn=fn, leaves=leaves):
                outs = fn(leaves[:n], leaves[n:n + J], leaves[-1])
                torch.autograd.backward(outs, douts)

            both = do_bench(step, warmup=5, rep=50, grad_to_none=leaves)
            times[name] = (fwd, both)
        (df, db), (tf, tb) = times["direct"], times["two-phase"]
        print(f"{n:>6}  {df:>10.3f}  {tf:>11.3f}  {df / tf:>5.2f}  {db:>10.3f}  {tb:>11.3f}  {db / tb:>5.2f}")
        rows.append([n, round(df, 3), round(tf, 3), round(df / tf, 2), round(db, 3), round(tb, 3), round(db / tb, 2)])
    save_result("attn-res", CLAIM, {"two-phase": table(
        ["sealed sources", "direct fwd ms", "two-phase fwd ms", "ratio", "direct fwd+bwd ms", "two-phase fwd+bwd ms",
         "ratio"], rows, note=f"One block's J = {J} reads, N = {N:,}, D = {D}, fp32; ratio = direct / two-phase.")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
