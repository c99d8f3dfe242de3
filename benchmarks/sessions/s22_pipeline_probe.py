"""Session 22 probe (issue 5): the inference forward as a pipeline of segments (`TUNING["prefill_segments"]`: each
segment's state pass on a high-priority side stream beside the next segment's prepare), timed interleaved in one
process at the issue's inference shapes, each config's outputs checked bit-identical to the first config's.

    PYTHONPATH=. python3 benchmarks/sessions/s22_pipeline_probe.py --out /tmp/probe.json [--configs JSON]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import threading

import torch
import triton

from benchmarks.kda import VARLEN_MIX, cu_tensor, ours_fn, prefill_at_every_size, raw_inputs, reference_fn, rel
from k3.ops.kda import triton_chunk, triton_common, triton_prefill

CONFIGS = [{}, {"prefill_segments": 2}, {"prefill_segments": 3}, {"prefill_segments": 4}, {"prefill_segments": 6},
           {"prefill_segments": 8}, {"prefill_segments": 16}, {"prefill_chunk": 32},
           {"prefill_chunk": 32, "prefill_segments": 4}]
# (name, B, T, H, document lengths, whether the inference kernels are forced where chunk_kda would not pick them)
SHAPES = [("B=1 T=8192 H=96", 1, 8192, 96, None, False), ("B=1 T=8192 H=64", 1, 8192, 64, None, False),
          ("varlen6 H=96", 1, 8192, 96, VARLEN_MIX, False), ("varlen8 H=96", 1, 8192, 96, [1024] * 8, False),
          ("B=1 T=32768 H=32", 1, 32768, 32, None, False), ("B=1 T=32768 H=32 forced", 1, 32768, 32, None, True)]
# run 2: the new defaults' rule at few programs (the small preset's KDA layer has H = 8)
SHAPES_RUN2 = [("B=1 T=8192 H=96", 1, 8192, 96, None, False), ("B=1 T=8192 H=64", 1, 8192, 64, None, False),
               ("B=1 T=32768 H=32", 1, 32768, 32, None, False), ("B=4 T=4096 H=8", 4, 4096, 8, None, False),
               ("B=2 T=8192 H=8 forced", 2, 8192, 8, None, True), ("B=1 T=16384 H=8 forced", 1, 16384, 8, None, True)]
# run 5: the rule's edges (64 programs at 2^19 token-heads; 32 and 16 programs at 2^20), natural and forced
SHAPES_RUN5 = [("B=2 T=16384 H=16", 2, 16384, 16, None, False), ("B=2 T=16384 H=16 forced", 2, 16384, 16, None, True),
               ("B=1 T=65536 H=16", 1, 65536, 16, None, False), ("B=1 T=65536 H=16 forced", 1, 65536, 16, None, True),
               ("B=1 T=131072 H=8", 1, 131072, 8, None, False),
               ("B=1 T=131072 H=8 forced", 1, 131072, 8, None, True)]
# session 25: the segment tail where the state pass has more programs than SMs, and beside it
SHAPES_S25 = [("B=1 T=4096 H=96", 1, 4096, 96, None, False), ("B=1 T=16384 H=96", 1, 16384, 96, None, False),
              ("B=1 T=8192 H=128", 1, 8192, 128, None, False), ("B=1 T=8192 H=80", 1, 8192, 80, None, False)]


def producers_first(device, n, produce, consume):
    """`pipelined` with every producer enqueued before the first consumer (config key "_producers_first"; session 25
    run 3: ties at steady state, 1.321 against 1.320 ms at the K3 shape, so not adopted)."""
    with torch.cuda.device(device):
        main, side = torch.cuda.current_stream(device), triton_common._side_stream(device, threading.get_ident())
        ready = []
        for i in range(n):
            produce(i)
            ready.append(torch.cuda.Event())
            ready[-1].record(main)
        with torch.cuda.stream(side):
            for i in range(n):
                side.wait_event(ready[i])
                consume(i)
        main.wait_stream(side)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="", help="a JSON list of TUNING overrides instead of CONFIGS")
    ap.add_argument("--run2", action="store_true", help="run 2's shapes (SHAPES_RUN2)")
    ap.add_argument("--run5", action="store_true", help="run 5's shapes (SHAPES_RUN5)")
    ap.add_argument("--rotate", action="store_true",
                    help="start each round at the next config (session 24: an order effect between two configs)")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the fp64 error section")
    ap.add_argument("--shapes", default="", help="comma-separated shape names: only these (session 25)")
    args = ap.parse_args()
    shapes = SHAPES_RUN2 if args.run2 else SHAPES_RUN5 if args.run5 else SHAPES
    if args.shapes:
        shapes = [s for s in SHAPES + SHAPES_RUN2 + SHAPES_RUN5 + SHAPES_S25 if s[0] in args.shapes.split(",")]
        shapes = list({s[0]: s for s in shapes}.values())
    configs = json.loads(args.configs) if args.configs else CONFIGS
    base = dict(triton_chunk.TUNING)

    def use(cfg):
        triton_chunk.TUNING.clear()
        triton_chunk.TUNING.update(base, **{k: v for k, v in cfg.items() if not k.startswith("_")})
        triton_prefill.pipelined = producers_first if cfg.get("_producers_first") else triton_common.pipelined

    rows = [{"tuning": cfg, "ms": {}, "same": {}} for cfg in configs]
    for name, B, T, H, lengths, force in shapes:
        cu = None if lengths is None else cu_tensor(lengths, "cuda")
        ins = raw_inputs(B, T, H, N=None if lengths is None else len(lengths), seed=4, device="cuda", h0=True)

        def fwd():
            with torch.no_grad(), (prefill_at_every_size() if force else contextlib.nullcontext()):
                return ours_fn(ins, cu)

        first = None
        for row in rows:
            use(row["tuning"])
            out = fwd()
            torch.cuda.synchronize()
            if first is None:
                first = out
            row["same"][name] = all(torch.equal(a, b) for a, b in zip(first, out))
        for rnd in range(args.rounds):
            shift = rnd % len(rows) if args.rotate else 0
            for row in rows[shift:] + rows[:shift]:
                use(row["tuning"])
                row["ms"].setdefault(name, []).append(triton.testing.do_bench(fwd, warmup=10, rep=100))
        for row in rows:
            t = sorted(row["ms"][name])
            print(f"[fwd {name}] {json.dumps(row['tuning'])}: median {t[len(t) // 2]:.3f} ms {[round(x, 3) for x in t]}"
                  f" same-as-first {row['same'][name]}", flush=True)
        del ins, first
        torch.cuda.empty_cache()
    # the default's error from fp64 with the pipeline on (bit-identical results make the others' the same)
    for name, T, H, lengths in () if args.no_accuracy else (("dense T=8192 H=4", 8192, 4, None),
                                                            ("varlen T=8192 H=4", 8192, 4, VARLEN_MIX)):
        cu = None if lengths is None else cu_tensor(lengths, "cuda")
        ins = raw_inputs(1, T, H, N=None if lengths is None else len(lengths), seed=11, device="cuda", h0=True)
        with torch.no_grad():
            ref = reference_fn(ins, cu)
            for row in rows[:2] + rows[3:4]:
                use(row["tuning"])
                with prefill_at_every_size():
                    o, S = ours_fn(ins, cu)
                print(f"[accuracy] {name} {json.dumps(row['tuning'])}: o {rel(o, ref[0]):.2e} S {rel(S, ref[1]):.2e}",
                      flush=True)
    use({})
    names = [s[0] for s in shapes]
    print("\nconfig | " + " | ".join(names))
    for row in rows:
        med = [sorted(row["ms"][n])[len(row["ms"][n]) // 2] for n in names]
        print(json.dumps(row["tuning"]) + " | " + " | ".join(
            f"{m:.3f}{'' if row['same'][n] else ' (DIFFERS)'}" for m, n in zip(med, names)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
