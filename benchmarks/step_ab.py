"""Interleaved A/B timing of launch settings inside one training step: one model, one process.

`train_throughput.py` times one variant per process, so two settings compare across processes, machines'
warm-up and clock drift; differences of 0.2% (what the last MFU points are made of) drown in that. Here
one model trains under every setting in turn, round after round (the order rotates each round), so a
setting's paired difference to the first one is measured a few seconds apart, many times.

Each setting is a `;`-separated list of `module.DICT.key=value` for dicts in `k3.ops.<module>`; "" is the
defaults. The settings must be ones the code reads at
call time (launch tables, `weight_grads.OPTIONS`), not at model build.

    python -m benchmarks.step_ab --seq-len 4096 --tokens 65536 --micro-batches 4 --rounds 6 \\
        --settings "" "weight_grads.OPTIONS.in_place=False" "attn_res.READ_TILES.bwd_per_sm=8"

Prints per setting the median step, the median paired difference to the first setting with its
interquartile range, and MFU against the GEMM peak measured in the same run; the table goes to `--result-table`
of benchmarks/results/step-ab-<device>.json.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import save_result  # noqa: E402
from benchmarks.provenance import table as result_table  # noqa: E402
from benchmarks.train_throughput import (Batch, build, flops_per_token, measured_gemm_peak, sync,  # noqa: E402
                                         variant_overrides)
from k3.train.config import TrainConfig  # noqa: E402
from k3.train.loop import train_step  # noqa: E402


def parse_setting(text: str) -> list[tuple[dict, str, object]]:
    """"module.DICT.key=value;..." -> [(dict, key, value)], each dict checked to hold the key."""
    items = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        target, sep, value = item.partition("=")
        parts = target.split(".")
        if not sep or len(parts) != 3:
            raise SystemExit(f"setting {item!r}: expected module.DICT.key=value")
        module, table, key = parts
        mapping = getattr(importlib.import_module(f"k3.ops.{module}"), table)
        if key not in mapping:
            raise SystemExit(f"setting {item!r}: k3.ops.{module}.{table} has no key {key!r} "
                             f"(keys: {', '.join(map(str, mapping))})")
        items.append((mapping, key, ast.literal_eval(value)))
    return items


class Applied:
    """Context manager: apply a parsed setting, restore the previous values on exit."""

    def __init__(self, items):
        self.items, self.saved = items, []

    def __enter__(self):
        self.saved = [(mapping, key, mapping[key]) for mapping, key, _ in self.items]
        for mapping, key, value in self.items:
            mapping[key] = value

    def __exit__(self, *exc):
        for mapping, key, value in reversed(self.saved):
            mapping[key] = value


def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--kda-impl", default="triton")
    parser.add_argument("--variant", default="fast", help="a train_throughput variant (fast, fast-ckpt, ...)")
    parser.add_argument("--rounds", type=int, default=6, help="timed steps per setting, after one warm-up each")
    parser.add_argument("--settings", nargs="+", default=[""], help='the first is the baseline; "" = defaults')
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--result-table", default="settings", help="the table of the results file this run writes")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    settings = [(text, parse_setting(text)) for text in args.settings]
    device = torch.device(args.device)
    peak = measured_gemm_peak(device)
    overrides, ckpt = variant_overrides(args.variant)
    overrides["kda_impl"] = args.kda_impl
    record: list[float] = []
    config, model, optimizer, scheduler = build(args.variant, args.preset, overrides, ckpt, device, record)
    rows = max(1, args.tokens // args.seq_len)
    batches = [Batch(rows, args.seq_len, config.vocab_size, device, seed=i) for i in range(args.micro_batches)]
    cfg = TrainConfig(preset=args.preset)
    started = time.perf_counter()

    def timed_step(items) -> float:
        with Applied(items):
            sync(device)
            t = time.perf_counter()
            metrics = train_step(model, optimizer, scheduler, batches, cfg, device)
            sync(device)
        if not torch.isfinite(torch.tensor(metrics["loss"])):
            raise SystemExit(f"non-finite loss under setting {items}")
        return time.perf_counter() - t

    for text, items in settings:  # warm-up: compiles every setting's kernels
        first = timed_step(items)
        print(f"[{time.perf_counter() - started:6.0f}s] warm-up {text or 'defaults'!r}: {first:.3f} s", flush=True)
    times = {text: [] for text, _ in settings}
    for r in range(args.rounds):
        order = settings[r % len(settings):] + settings[:r % len(settings)]
        for text, items in order:
            times[text].append(timed_step(items))
        print(f"[{time.perf_counter() - started:6.0f}s] round {r + 1}/{args.rounds}: "
              + ", ".join(f"{times[t][-1]:.3f}" for t, _ in settings), flush=True)

    tokens = rows * args.seq_len * args.micro_batches
    mean_context = statistics.mean(b.mean_context() for b in batches)
    mm, attn = flops_per_token(model, config, mean_context, config.kda_chunk_size)
    base = times[settings[0][0]]
    table = Table(title=f"{args.preset} T={args.seq_len}, {args.tokens} tokens × {args.micro_batches} micro-batches, "
                        f"{args.rounds} interleaved rounds, GEMM peak {peak / 1e12:.1f} TFLOP/s")
    for col in ("setting", "median s", "min s", "paired Δ vs first (median)", "Δ IQR", "TFLOP/s", "MFU"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    results = []
    for text, _ in settings:
        xs = times[text]
        deltas = [x - b for x, b in zip(xs, base)]
        lo, hi = quartiles(deltas)
        median = statistics.median(xs)
        achieved = (mm + attn) * tokens / median
        results.append(dict(setting=text, step_s=xs, median_s=median, paired_delta_median_s=statistics.median(deltas),
                            paired_delta_iqr_s=[lo, hi], tflop_s=achieved / 1e12, mfu=achieved / peak))
        table.add_row(text or "defaults", f"{median:.4f}", f"{min(xs):.4f}", f"{statistics.median(deltas):+.4f}",
                      f"[{lo:+.4f}, {hi:+.4f}]", f"{achieved / 1e12:.1f}", f"{100 * achieved / peak:.2f}%")
    Console(width=200).print(table)
    if device.type == "cuda":
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    rows = [[r["setting"] or "defaults", round(r["median_s"], 4),
             None if i == 0 else f"{1e3 * r['paired_delta_median_s']:+.1f}",
             None if i == 0 else "[{:+.1f}, {:+.1f}]".format(*(1e3 * x for x in r["paired_delta_iqr_s"]))]
            for i, r in enumerate(results)]
    save_result("step-ab", f"Settings compared inside one training step of the {args.preset} preset ({args.tokens} "
                f"tokens × {args.micro_batches} micro-batches, T = {args.seq_len}), interleaved in one process: each "
                "setting's paired difference to the first",
                {args.result_table: result_table(["setting", "median step s", "paired Δ ms (median)", "Δ IQR ms"],
                                                 rows)},
                raw={args.result_table: {"args": vars(args), "peak_tflop_s": peak / 1e12, "results": results}})


if __name__ == "__main__":
    main()
