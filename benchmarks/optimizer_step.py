"""`MuonAdamW.step()`: the foreach reference against the fused step, side by side in one run.

The preset's parameters in fp32 on the device (as train_throughput builds them: bf16 autocast changes only
activations), gradients filled with randn once, Newton–Schulz in bf16 on CUDA (fp32 on CPU), as `k3 train`
runs it. Each
impl steps its own copy of the model and optimizer state:
- `reference`: `impl="reference"`, the foreach chains (AdamW about ten passes, Muon lerp, lerp, cast,
  mul_, add_);
- `fused`: `impl="fused"`, torch's fused AdamW kernel and the two multi-tensor Triton kernels of
  k3/optim/fused_muon.py. Newton–Schulz is the same code in both.

Correctness gate before timing: from the same parameters, `--gate-steps` steps of each on the same gradients;
Muon parameters must agree to 1e-6 relative (on CUDA they are expected bit for bit: both paths give
Newton–Schulz the same bf16 input; the table says whether they were), AdamW parameters to 1e-6 relative
(the fused kernel orders its ops differently).
Timing: after `--warmup` steps, `--steps` steps each between CUDA events (wall clock on CPU), median and
IQR; also the wall clock of a synchronised step, and on CUDA the summed kernel time of one step
(torch.profiler). Split: the same step with events around its parts: the AdamW group, the Muon group, and
inside it Newton–Schulz (`_orthogonalize`); Muon elementwise = Muon group − Newton–Schulz.

    python -m benchmarks.optimizer_step                      # one GPU, small preset
    python -m benchmarks.optimizer_step --profile            # also the top kernels of each step
    python -m benchmarks.optimizer_step --quick              # debug preset, gate and a smoke timing (any device;
                                                             # CPU runs the Triton kernels in the interpreter)

Results: table "step" of benchmarks/results/optimizer-step-<device>.json (not written by --quick unless --out
names a folder).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from k3.config import get_preset  # noqa: E402
from k3.model.model import build_model  # noqa: E402
from k3.optim import MuonAdamW  # noqa: E402

from benchmarks.provenance import save_result  # noqa: E402
from benchmarks.provenance import table as result_table  # noqa: E402

IMPLS = ("reference", "fused")


class Clock:
    """Intervals on the device's timeline: CUDA events on CUDA, the wall clock (synchronous) on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def time_steps(opt: MuonAdamW, clock: Clock, warmup: int, steps: int) -> dict:
    """Median and IQR of the step between events, and the median wall clock of a synchronised step."""
    for _ in range(warmup):
        opt.step()
    clock.sync()
    marks = [clock.mark()]
    for _ in range(steps):
        opt.step()
        marks.append(clock.mark())
    clock.sync()
    times = sorted(clock.ms(a, b) for a, b in zip(marks, marks[1:]))
    wall = []
    for _ in range(max(3, steps // 4)):
        clock.sync()
        t = time.perf_counter()
        opt.step()
        clock.sync()
        wall.append((time.perf_counter() - t) * 1e3)
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"ms": statistics.median(times), "iqr": q[2] - q[0], "wall_ms": statistics.median(wall)}


def split_step(opt: MuonAdamW, clock: Clock, steps: int) -> dict:
    """Median ms of the AdamW group, the Muon group and Newton–Schulz inside it, events around each part."""
    parts = {"adamw": [], "muon": [], "ns": []}

    def timed(key, fn):
        def run(*args):
            start = clock.mark()
            out = fn(*args)
            parts[key].append((start, clock.mark()))
            return out
        return run

    opt._adamw_step = timed("adamw", opt._adamw_step)
    opt._muon_step = timed("muon", opt._muon_step)
    opt._orthogonalize = timed("ns", opt._orthogonalize)
    try:
        for _ in range(steps):
            opt.step()
        clock.sync()
    finally:
        del opt._adamw_step, opt._muon_step, opt._orthogonalize  # back to the class's methods
    ms = {k: statistics.median(clock.ms(a, b) for a, b in v) for k, v in parts.items()}
    ms["muon_elementwise"] = ms["muon"] - ms["ns"]
    return ms


def max_rel(models: list, names: set[str]) -> tuple[float, bool]:
    """Largest |a − b| / max|b| over the named parameters of two models, and whether all are bitwise equal."""
    worst, bitwise = 0.0, True
    params = [dict(m.named_parameters()) for m in models]
    for name in names:
        a, b = params[1][name].detach(), params[0][name].detach()
        bitwise &= torch.equal(a, b)
        worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    return worst, bitwise


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per impl")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gate-steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--quick", action="store_true", help="debug preset, 2 timed steps: gate and smoke timing")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of each impl's step")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results; --quick: none)")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.warmup, args.gate_steps = "debug", 2, 1, 2
    device = torch.device(args.device)
    clock = Clock(device)
    config = get_preset(args.preset)
    ns_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as `k3 train` runs it

    base = build_model(config, seed=0, device=device)
    models, opts = [], []
    for impl in IMPLS:
        model = copy.deepcopy(base)
        gen = torch.Generator(device=device).manual_seed(0)  # the same gradients for every impl
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype)
        models.append(model)
        opts.append(MuonAdamW(model.named_parameters(), config, lr=args.lr, ns_dtype=ns_dtype, impl=impl))
    del base
    n_muon = sum(p.numel() for p in opts[0].param_groups[0]["params"])
    n_adamw = sum(p.numel() for p in opts[0].param_groups[1]["params"])

    # correctness gate
    for _ in range(args.gate_steps):
        for opt in opts:
            opt.step()
    muon_rel, muon_bitwise = max_rel(models, set(opts[0].param_groups[0]["param_names"]))
    adamw_rel, adamw_bitwise = max_rel(models, set(opts[0].param_groups[1]["param_names"]))
    passed = muon_rel <= 1e-6 and adamw_rel <= 1e-6
    print(f"{'ok  ' if passed else 'FAIL'} gate after {args.gate_steps} steps: Muon max rel {muon_rel:.1e} "
          f"(bitwise: {muon_bitwise}), AdamW max rel {adamw_rel:.1e} (bitwise: {adamw_bitwise})")
    if not passed:
        raise SystemExit(1)

    results = {}
    for impl, opt in zip(IMPLS, opts):
        r = time_steps(opt, clock, args.warmup, args.steps)
        r["split"] = split_step(opt, clock, max(2, args.steps // 2))
        if clock.cuda:
            from benchmarks.kernel_profile import kernel_times, print_kernel_times

            if args.profile:
                r["kernel_ms"] = print_kernel_times(f"{impl} step", opt.step, iters=3)
            else:
                r["kernel_ms"] = sum(ms for ms, _ in kernel_times(opt.step, iters=3).values())
        results[impl] = r

    console = Console(width=200)
    where = torch.cuda.get_device_name() if clock.cuda else "CPU (Triton interpreter: timings are a smoke test)"
    table = Table(title=f"MuonAdamW.step(), {args.preset} preset on {where}: {n_muon / 1e6:.1f}M Muon + "
                        f"{n_adamw / 1e6:.1f}M AdamW parameters (fp32), {str(ns_dtype)[6:]} Newton–Schulz")
    for col in ("impl", "step ms", "IQR", "wall ms", "kernel ms", "AdamW ms", "Muon elementwise ms",
                "Newton–Schulz ms", "vs reference"):
        table.add_column(col, justify="right")
    ref = results["reference"]
    for impl, r in results.items():
        s = r["split"]
        table.add_row(impl, f"{r['ms']:.2f}", f"{r['iqr']:.2f}", f"{r['wall_ms']:.2f}",
                      f"{r['kernel_ms']:.2f}" if "kernel_ms" in r else "–", f"{s['adamw']:.2f}",
                      f"{s['muon_elementwise']:.2f}", f"{s['ns']:.2f}", f"{ref['ms'] / r['ms']:.2f}×")
    console.print(table)
    console.print("step ms: between CUDA events, median of the timed steps; wall ms: a synchronised step; kernel ms: "
                  "summed kernel time of one step (profiler); parts: events around each part of the step")

    if args.quick and not args.out:
        return
    names = {"reference": "reference (foreach)", "fused": "fused"}
    rows = [[names.get(impl, impl), round(r["ms"], 2), round(r["split"]["adamw"], 2),
             round(r["split"]["muon_elementwise"], 2), round(r["split"]["ns"], 2), f"{ref['ms'] / r['ms']:.2f}×"]
            for impl, r in results.items()]
    save_result("optimizer-step",
                f"One MuonAdamW step of the {args.preset} preset ({n_muon:,} Muon + {n_adamw:,} AdamW fp32 "
                f"parameters, {str(ns_dtype)[6:]} Newton–Schulz): the foreach reference against the fused kernels",
                {"step": result_table(["impl", "step ms", "AdamW ms", "Muon elementwise ms", "Newton–Schulz ms",
                                       "speed-up"], rows,
                                      note=f"Gate: Muon bitwise equal to the reference ({muon_bitwise}), AdamW "
                                           f"{adamw_rel:.1e} relative (bound 1e-06).")},
                raw={"preset": args.preset, "muon_params": n_muon, "adamw_params": n_adamw, "ns_dtype": str(ns_dtype),
                     "gate": {"muon_max_rel": muon_rel, "muon_bitwise": muon_bitwise, "adamw_max_rel": adamw_rel,
                              "threshold": 1e-6}, "results": results},
                out=args.out)


if __name__ == "__main__":
    main()
