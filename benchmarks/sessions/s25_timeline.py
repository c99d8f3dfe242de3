"""Session 25 probe (issue 5): where the inference forward's pipeline spends its time. For each TUNING config, one
forward at each shape under torch.profiler (after warm-up); prints every kernel with its stream, start and end in µs
from the first kernel's start, and per stream the busy time, so the head (the first prepare alone), the overlap and
the tail (the last state pass alone) can be read off.

    PYTHONPATH=. python3 benchmarks/sessions/s25_timeline.py [--configs JSON] [--shapes B,T,H;...]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from benchmarks.kda import ours_fn, raw_inputs
from benchmarks.sessions.s22_pipeline_probe import producers_first
from k3.ops.kda import triton_chunk, triton_common, triton_prefill


def kernels(fn):
    """[(name, stream, start µs, end µs)] of the CUDA kernels of one fn() call, from a chrome trace."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    ks = [(e["name"], e["args"].get("stream"), float(e["ts"]), float(e["ts"]) + float(e["dur"]))
          for e in events if e.get("cat") == "kernel"]
    t0 = min(k[2] for k in ks)
    return sorted([(n, s, a - t0, b - t0) for n, s, a, b in ks], key=lambda k: k[2])


def last_call(ks):
    """The kernels of the last of three calls (from its first `_prefill_prepare`: each call launches a third of
    them), re-based at that kernel's start."""
    starts = [i for i, k in enumerate(ks) if k[0].startswith("_prefill_prepare")]
    first = starts[len(starts) - len(starts) // 3]
    t0 = ks[first][2]
    return [(n, s, a - t0, b - t0) for n, s, a, b in ks[first:]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default='[{}]')
    ap.add_argument("--shapes", default="1,8192,96")
    args = ap.parse_args()
    base = dict(triton_chunk.TUNING)
    for shape in args.shapes.split(";"):
        B, T, H = (int(x) for x in shape.split(","))
        ins = raw_inputs(B, T, H, seed=4, device="cuda", h0=True)
        for cfg in json.loads(args.configs):
            triton_chunk.TUNING.clear()
            triton_chunk.TUNING.update(base, **{k: v for k, v in cfg.items() if not k.startswith("_")})
            triton_prefill.pipelined = producers_first if cfg.get("_producers_first") else triton_common.pipelined

            def fwd():
                with torch.no_grad():
                    return ours_fn(ins, None)

            for _ in range(5):
                fwd()
            torch.cuda.synchronize()
            # steady state: three calls back to back, the last one's kernels (the host has run ahead of the GPU)
            runs = [last_call(kernels(lambda: [fwd() for _ in range(3)])) for _ in range(3)]
            ks = min(runs, key=lambda r: max(k[3] for k in r))  # the fastest of three
            print(f"\n[timeline] B={B} T={T} H={H} {json.dumps(cfg)}: {max(k[3] for k in ks):.1f} µs "
                  f"(3 runs: {[round(max(k[3] for k in r), 1) for r in runs]})")
            busy = {}
            for name, stream, a, b in ks:
                short = name.split("(")[0][:28]
                busy[stream] = busy.get(stream, 0.0) + b - a
                print(f"  stream {stream:>3} {short:<28} {a:8.1f} {b:8.1f} {b - a:7.1f}")
            print("  busy per stream µs: " + ", ".join(f"{s}: {t:.1f}" for s, t in busy.items()))
    triton_chunk.TUNING.clear()
    triton_chunk.TUNING.update(base)


if __name__ == "__main__":
    main()
