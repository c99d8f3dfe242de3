"""Forward and forward+backward tokens/s of the debug and tiny presets on this CPU.

A baseline for later work (not a test). Correctness gate first: the model's loss must be finite and
close to ln(V) at init. Run: `python benchmarks/model_cpu.py [--presets debug tiny] [--seq-len 256]`; the table
goes to benchmarks/results/model-<device>.json.
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.provenance import save_result  # noqa: E402
from benchmarks.provenance import table as result_table  # noqa: E402
from k3.config import get_preset  # noqa: E402
from k3.model.accounting import account  # noqa: E402
from k3.model.model import build_model  # noqa: E402


def timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--presets", nargs="+", default=["debug", "tiny"])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    table = Table(title=f"k3 model on CPU ({args.threads} threads, batch {args.batch_size} × {args.seq_len} tokens, fp32)")
    for col in ("preset", "kda impl", "attn_res impl", "params total / active", "fwd tok/s", "fwd+bwd tok/s", "fwd+bwd GFLOP/s (6·N_act)"):
        table.add_column(col, justify="right")
    rows = []
    for name in args.presets:
        # the defaults first, then each reference path swapped in one at a time
        for kda_impl, attn_res_impl in (("torch", "two_phase"), ("naive", "two_phase"), ("recurrent", "two_phase"),
                                        ("torch", "direct")):
            config = get_preset(name).replace(kda_impl=kda_impl, attn_res_impl=attn_res_impl)
            model = build_model(config, seed=0)
            ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len))
            tokens = ids.numel()

            def loss_fn():
                logits = model(ids).logits
                return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

            with torch.no_grad():
                loss = loss_fn().item()
            if not (math.isfinite(loss) and abs(loss - math.log(config.vocab_size)) < 1.0):
                raise SystemExit(f"correctness gate failed for {name}: loss at init {loss} vs ln V")

            def forward():
                with torch.no_grad():
                    loss_fn()

            def forward_backward():
                model.zero_grad(set_to_none=True)
                loss_fn().backward()

            t_fwd = timed(forward, 1, args.iters)
            t_fb = timed(forward_backward, 1, args.iters)
            acc = account(config)
            flops = 6 * acc.active_params * tokens / t_fb
            table.add_row(name, kda_impl, attn_res_impl, f"{acc.total_params / 1e6:.1f}M / {acc.active_params / 1e6:.1f}M",
                          f"{tokens / t_fwd:,.0f}", f"{tokens / t_fb:,.0f}", f"{flops / 1e9:.1f}")
            rows.append([name, kda_impl, attn_res_impl, f"{acc.total_params / 1e6:.1f}M / {acc.active_params / 1e6:.1f}M",
                         round(tokens / t_fwd), round(tokens / t_fb), round(flops / 1e9, 1)])
    Console(width=160).print(table)
    save_result("model", f"Forward and forward+backward tokens/s of the model on this CPU ({args.threads} threads, "
                f"batch {args.batch_size} × {args.seq_len} tokens, fp32), reference paths swapped in one at a time",
                {"tokens-per-second": result_table(["preset", "kda impl", "attn_res impl", "params total / active",
                                                    "fwd tok/s", "fwd+bwd tok/s", "fwd+bwd GFLOP/s (6·N_act)"], rows)})


if __name__ == "__main__":
    main()
