"""KDA short conv + SiLU: the fused Triton kernel (`short_conv_silu`) against the unfused path it replaces in
training (`causal_conv1d` + `F.silu`), side by side on the same inputs, forward and forward+backward.

Shapes: the q/k/v conv of one KDA layer, input a column slice of the 6-way projection output as in the model;
small preset (P = 1024) and K3 (P = 96·128 = 12,288), packed documents [1300, 547, 2048, 963, 271, 3063]
per 8,192 tokens. Times: median of `triton.testing.do_bench` (ms); GB/s counts the unavoidable bytes
(read x, write y; backward: read x and dy, write dx). A correctness gate (fused vs fp64, fp32 inputs,
≤ 1e-5) runs before timing.

    python -m benchmarks.short_conv            # one GPU
    python -m benchmarks.short_conv --quick    # tiny shapes, gate only (any device; CPU via the interpreter)
    python -m benchmarks.short_conv --profile  # also the CUDA kernels of one fused forward+backward, by time
    python -m benchmarks.short_conv --row-widths 4232 4240  # x sliced from rows of these widths (alignment)
    python -m benchmarks.short_conv --bwd-tiles 32x64x4 64x64x8  # kernel times at other backward tiles
    python -m benchmarks.short_conv --stream 128x512x2x3 256x1024x4x3  # the streaming kernels' settings
    python -m benchmarks.short_conv --bwd-tiles 16x64x8x8 16x64x8x8x2  # backward kernel 1 over several token
                                   # blocks per program (BTxBCxWARPSxBLOCKS[xSTAGES]; kernel 2 at its tiles)

On a GPU the default run writes table "vs-unfused" and --stream table "stream" of
benchmarks/results/short-conv-<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch.nn.functional as F  # noqa: E402

from k3.ops import short_conv as short_conv_module  # noqa: E402
from k3.ops.short_conv import causal_conv1d, naive_short_conv_silu, short_conv_silu  # noqa: E402

from benchmarks.provenance import save_result, table  # noqa: E402

CLAIM = ("KDA's short convolution + SiLU: the fused Triton kernels against the unfused torch form, and the streaming "
         "kernels' launch settings; bf16, packed documents")

DOCS = [1300, 547, 2048, 963, 271, 3063]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(T, C, device, dtype, seed=0, width=None):
    """A [1, T, width] projection output (x is its column slice C:2C, as the model slices q/k/v), the conv
    weight and packed cu_seqlens."""
    g = torch.Generator(device=device).manual_seed(seed)
    wide = torch.randn(1, T, width or 3 * C, device=device, generator=g).to(dtype)
    w = torch.randn(C, 1, 4, device=device, generator=g) * 0.5
    reps = -(-T // sum(DOCS))
    lengths = (DOCS * reps)
    cu = torch.tensor([0] + lengths, device=device).cumsum(0)
    cu = cu[cu < T]
    cu = torch.cat([cu, torch.tensor([T], device=device)])
    return wide, w, cu


def gate(device):
    wide, w, cu = inputs(300 if device == "cuda" else 70, 96 if device == "cuda" else 24, device, torch.float32)
    C = w.shape[0]
    x64, w64 = wide[..., C:2 * C].double().requires_grad_(), w.double().requires_grad_()
    ref = naive_short_conv_silu(x64, w64, cu)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    x, wf = wide.clone().requires_grad_(), w.clone().requires_grad_()
    out = short_conv_silu(x[..., C:2 * C], wf, cu)
    out.backward(dy.float())
    errs = {"y": rel(out, ref), "dx": rel(x.grad[..., C:2 * C], x64.grad), "dw": rel(wf.grad, w64.grad)}
    return errs, all(e <= 1e-5 for e in errs.values())


def profile_fused(device, T=8192, C=1024, iters=10):
    """CUDA time per kernel of the fused forward+backward at the small preset's shape, as the model calls it
    (gradient into the column slice only, so no zero-filled gradient of the wide projection is timed)."""
    from benchmarks.kernel_profile import print_kernel_times

    wide, w, cu = inputs(T, C, device, torch.bfloat16)
    x = wide[..., C:2 * C].detach().requires_grad_()
    wg = w.clone().requires_grad_()
    dy = torch.randn(1, T, C, device=device, dtype=torch.bfloat16)

    def step():
        return torch.autograd.grad(short_conv_silu(x, wg, cu), (x, wg), dy)

    print_kernel_times(f"fused fwd+bwd, T={T} C={C}", step, iters, top=10)


def backward_tilings(device, tilings, iters=10, shapes=((32768, 1024, 4240), (8192, 12288, None))):
    """GPU kernel time of the fused forward + backward (the profiler's sum, without the host's Python and autograd
    time that the small shapes' wall-clock rows hold) with kernel 1 at one token block per program (at the current
    `_CONV_BWD_*` tiles: the baseline) and at each of `tilings`,
    32K tokens at the small width (rows padded as the model pads them) and 8K tokens at K3's; each tiling passes
    the fp64 gate first. A tiling is "BTxBCxWARPS" (both backward kernels, kernel 1 one token block per program)
    or "BTxBCxWARPSxBLOCKS[xSTAGES]" (kernel 1 as `_conv_silu_grad_blocks_kernel`, BLOCKS token blocks of BT per
    program, STAGES-deep prefetch, default 1; kernel 2 at the current tiles)."""
    from benchmarks.kernel_profile import kernel_times

    keys = ("_CONV_BWD_BT", "_CONV_BWD_BC", "_CONV_BWD_WARPS", "_CONV_GRAD_BLOCKS", "_CONV_GRAD_BLOCKS_INTERPRETED")
    default = tuple(getattr(short_conv_module, k) for k in keys)
    streams = tuple(getattr(short_conv_module, k) for k in ("_CONV_FWD_STREAM", "_CONV_BWD_STREAM"))
    short_conv_module._CONV_FWD_STREAM = short_conv_module._CONV_BWD_STREAM = None  # the tile kernels are timed here
    try:
        shipped = "x".join(map(str, default[3])) if default[3] else None  # the GPU's default kernel 1, timed too
        for tiling in [None, *([shipped] if shipped and shipped not in tilings else []), *tilings]:
            tiles = tuple(map(int, tiling.split("x"))) if tiling else default[:3]
            if len(tiles) not in (3, 4, 5):
                raise SystemExit(f"--bwd-tiles: {tiling!r} is not BTxBCxWARPS or BTxBCxWARPSxBLOCKS[xSTAGES]")
            settings = tiles + (None, None) if len(tiles) == 3 else default[:3] + ((tiles + (1,))[:5],) * 2
            for key, value in zip(keys, settings):
                setattr(short_conv_module, key, value)
            errs, ok = gate(device)
            label = "x".join(map(str, tiles)) + (" (one block per program: the baseline)" if tiling is None else "")
            print(f"[bwd tiles] {label}: gate", {k: f"{v:.1e}" for k, v in errs.items()}, "ok" if ok else "FAILED")
            if not ok or device != "cuda":
                continue
            for T, C, width in shapes:
                wide, w, cu = inputs(T, C, device, torch.bfloat16, width=width)
                x = wide[..., C:2 * C].detach().requires_grad_()
                wg = w.clone().requires_grad_()
                dy = torch.randn(1, T, C, device=device, dtype=torch.bfloat16)
                times = kernel_times(lambda: torch.autograd.grad(short_conv_silu(x, wg, cu), (x, wg), dy), iters)
                conv = {k.split("(")[0][:27]: ms for k, (ms, _) in times.items() if "_conv_silu" in k}
                # all kernels: also the sum of the dw partials, fewer rows with BLOCKS
                total = sum(ms for ms, _ in times.values())
                print(f"[bwd tiles] {label} T={T} C={C}: all kernels {total * 1e3:.0f} us; " + ", ".join(
                    f"{k} {ms * 1e3:.0f} us" for k, ms in conv.items()), flush=True)
    finally:
        for key, value in zip(keys, default):
            setattr(short_conv_module, key, value)
        short_conv_module._CONV_FWD_STREAM, short_conv_module._CONV_BWD_STREAM = streams


def stream_settings(device, settings, iters=10, shapes=((65536, 1024, 4240), (8192, 12288, None))):
    """GPU kernel time (the profiler's sum) of the fused forward and forward + backward with the tile kernels (the
    baseline) and with the streaming kernels at each setting "SEGxBCxWARPSxSTAGES" (both directions),
    at a 64K-token step's small-preset conv (x a slice of the 4240-wide projection rows) and 8K tokens at K3's
    width. Each setting passes the fp64 gate first; GB/s counts the unavoidable bytes (forward: read x, write y;
    backward: read x and dy, write dx)."""
    from benchmarks.kernel_profile import kernel_times

    keys = ("_CONV_FWD_STREAM", "_CONV_BWD_STREAM", "_CONV_STREAM_INTERPRETED")
    default = tuple(getattr(short_conv_module, k) for k in keys)
    rows = []
    try:
        for setting in [None, *settings]:
            value = tuple(map(int, setting.split("x"))) if setting else None
            if value is not None and len(value) != 4:
                raise SystemExit(f"--stream: {setting!r} is not SEGxBCxWARPSxSTAGES")
            for key in keys:
                setattr(short_conv_module, key, value)
            label = setting or "tiles"
            errs, ok = gate(device)
            print(f"[stream] {label}: gate", {k: f"{v:.1e}" for k, v in errs.items()}, "ok" if ok else "FAILED",
                  flush=True)
            if not ok or device != "cuda":
                continue
            for T, C, width in shapes:
                wide, w, cu = inputs(T, C, device, torch.bfloat16, width=width)
                x = wide[..., C:2 * C].detach().requires_grad_()
                wg = w.clone().requires_grad_()
                dy = torch.randn(1, T, C, device=device, dtype=torch.bfloat16)
                with torch.no_grad():
                    fwd = sum(ms for ms, _ in kernel_times(lambda: short_conv_silu(x, wg, cu), iters).values())
                both = sum(ms for ms, _ in kernel_times(
                    lambda: torch.autograd.grad(short_conv_silu(x, wg, cu), (x, wg), dy), iters).values())
                nbytes = T * C * 2
                rows.append((label, T, C, fwd * 1e3, 2 * nbytes / fwd / 1e6, (both - fwd) * 1e3,
                             3 * nbytes / (both - fwd) / 1e6))
                print(f"[stream] {label} T={T} C={C}: fwd {fwd * 1e3:.0f} us ({2 * nbytes / fwd / 1e6:,.0f} GB/s), "
                      f"bwd {(both - fwd) * 1e3:.0f} us ({3 * nbytes / (both - fwd) / 1e6:,.0f} GB/s)", flush=True)
    finally:
        for key, value in zip(keys, default):
            setattr(short_conv_module, key, value)
    base = {(T, C): (f, b) for label, T, C, f, _, b, _ in rows if label == "tiles"}
    print(f"{'setting':>16} {'T':>6} {'C':>6} {'fwd us':>8} {'GB/s':>6} {'x tiles':>7} {'bwd us':>8} {'GB/s':>6} "
          f"{'x tiles':>7}")
    out = []
    for label, T, C, f, fg, b, bg in rows:
        f0, b0 = base.get((T, C), (f, b))
        print(f"{label:>16} {T:>6} {C:>6} {f:>8.0f} {fg:>6,.0f} {f0 / f:>6.2f}x {b:>8.0f} {bg:>6,.0f} {b0 / b:>6.2f}x")
        out.append([label, T, C, round(f), round(fg), f"{f0 / f:.2f}×", round(b), round(bg), f"{b0 / b:.2f}×"])
    if out:
        save_result("short-conv", CLAIM, {"stream": table(
            ["setting (SEG×BC×warps×stages)", "T", "C", "fwd µs", "fwd GB/s", "fwd vs tiles", "bwd µs", "bwd GB/s",
             "bwd vs tiles"], out, note="Kernel time per call (the profiler's sum); `tiles` is the earlier tile "
                                        "form. Every setting passed the fp64 gate first.")})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="kernel times of the fused forward+backward (small, T = 8192): what each call costs")
    ap.add_argument("--row-widths", nargs="*", type=int, default=[],
                    help="also the small preset at 32K tokens with x sliced from rows this wide (e.g. 4232 4240)")
    ap.add_argument("--bwd-tiles", nargs="*", default=None, metavar="BTxBCxWARPS[xBLOCKS[xSTAGES]]",
                    help="GPU kernel times of the fused conv at the backward's current tiles and at these (profiler); "
                         "with BLOCKS, kernel 1 sums dw over that many token blocks per program")
    ap.add_argument("--stream", nargs="*", default=None, metavar="SEGxBCxWARPSxSTAGES",
                    help="GPU kernel times of the streaming forward and backward at these settings against the tiles")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    errs, ok = gate(device)
    print("correctness gate (fused fp32 vs fp64):", {k: f"{v:.1e}" for k, v in errs.items()}, "ok" if ok else "FAILED")
    if not ok:
        return 1
    if args.quick or device != "cuda":
        if args.bwd_tiles is not None:  # the tile switching and its gates (kernel times need a GPU)
            backward_tilings(device, args.bwd_tiles)
        if args.stream is not None:
            stream_settings(device, args.stream)
        return 0
    if args.stream is not None:  # the streaming kernels' settings only (their own table)
        stream_settings(device, args.stream)
        return 0
    from triton.testing import do_bench

    rows = []
    shapes = [("small", 8192, 1024, None), ("small", 32768, 1024, None), ("k3", 8192, 12288, None)]
    # the small preset's KDA projection rows: 4·1024 + 8 + 128 = 4232 elements (not a multiple of 16) and padded to
    # 4240 as the model pads them (k3.model.kda.KimiDeltaAttention.input_projections)
    shapes += [("small", 32768, 1024, width) for width in args.row_widths]
    for preset, T, C, width in shapes:
        wide, w, cu = inputs(T, C, device, torch.bfloat16, width=width)
        if width:
            preset = f"{preset} w{width}"
        x = wide[..., C:2 * C]
        dy = torch.randn(1, T, C, device=device, dtype=torch.bfloat16)
        impls = {
            "unfused": lambda xx, ww: F.silu(causal_conv1d(xx, ww, cu_seqlens=cu)[0]),
            "fused": lambda xx, ww: short_conv_silu(xx, ww, cu),
        }
        times = {}
        for name, fn in impls.items():
            with torch.no_grad():
                fwd = do_bench(lambda: fn(x, w), warmup=10, rep=100)
            xg, wg = wide.clone().requires_grad_(), w.clone().requires_grad_()

            def step(fn=fn, xg=xg, wg=wg):
                return torch.autograd.grad(fn(xg[..., C:2 * C], wg), (xg, wg), dy)

            both = do_bench(step, warmup=10, rep=100)
            times[name] = (fwd, both)
        nbytes_f = 2 * T * C * 2
        nbytes_b = nbytes_f + 3 * T * C * 2
        for name, (fwd, both) in times.items():
            rows.append((preset, T, C, name, fwd, times["unfused"][0] / fwd, nbytes_f / fwd / 1e6,
                         both, times["unfused"][1] / both, nbytes_b / both / 1e6))
    if args.profile:
        profile_fused(device)
    if args.bwd_tiles is not None:
        backward_tilings(device, args.bwd_tiles)
    header = ("preset", "T", "C", "impl", "fwd ms", "fwd speedup", "fwd GB/s", "fwd+bwd ms", "speedup", "GB/s")
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"KDA short conv + SiLU on {torch.cuda.get_device_name()} (bf16, packed documents)")
        for h in header:
            table.add_column(h, justify="right")
        for r in rows:
            table.add_row(r[0], str(r[1]), str(r[2]), r[3], f"{r[4]:.3f}", f"{r[5]:.2f}x", f"{r[6]:,.0f}",
                          f"{r[7]:.3f}", f"{r[8]:.2f}x", f"{r[9]:,.0f}")
        Console(width=160).print(table)
    except ImportError:
        print(header)
        for r in rows:
            print(r)
    save_result("short-conv", CLAIM, {"vs-unfused": table(
        ["preset", "T", "C", "impl", "fwd ms", "fwd speed-up", "fwd+bwd ms", "fwd+bwd speed-up"],
        [[r[0], r[1], r[2], r[3], round(r[4], 3), f"{r[5]:.2f}×", round(r[7], 3), f"{r[8]:.2f}×"] for r in rows],
        note="ms = median of `do_bench`, host time included.")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
