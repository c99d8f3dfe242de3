"""Session 21 probe (issue 5): the inference forward's storage and product variants, timed interleaved in one
process at the K3 shape (B=1 T=8192 H=96) and H=64, with the fp64 gate and the inference forward's error against
the fp64 recurrence at T=8192 H=4 (dense, varlen) and T=32768 H=2.

    PYTHONPATH=. python3 benchmarks/sessions/s21_prefill_probe.py --out /tmp/probe.json

As run in session 21 run 2 (code 3daffa5): `prefill_u_bf16` was deleted after it (it lost), and the defaults it
compares against changed after it (16-token chunks, bf16 state products, tf32 inverses): a record, not a rerun.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from benchmarks.kda import (VARLEN_MIX, cu_tensor, forward_steps, ours_fn, prefill_at_every_size, raw_inputs,
                            reference_fn, rel, small_gate)
from benchmarks.kernel_profile import kernel_times
from k3.ops.kda import triton_chunk

CONFIGS = [{}, {"prefill_chunk": 16}, {"prefill_state_bf16": True}, {"prefill_chunk": 16, "prefill_state_bf16": True},
           {"prefill_u_bf16": True}, {"prefill_chunk": 16, "prefill_u_bf16": True}, {"prefill_inverse": "tf32"},
           {"prefill_chunk": 16, "prefill_inverse": "tf32"},
           {"prefill_state_bf16": True, "prefill_u_bf16": True, "prefill_inverse": "tf32"},
           {"prefill_chunk": 16, "prefill_state_bf16": True, "prefill_u_bf16": True, "prefill_inverse": "tf32"},
           {"prefill_chunk": 16, "prefill_state_bf16": True, "prefill_state_bv": 32},
           {"prefill_state_bf16": True, "prefill_state_bv": 32}]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="", help="a JSON list of TUNING overrides instead of CONFIGS")
    args = ap.parse_args()
    configs = json.loads(args.configs) if args.configs else CONFIGS
    base = dict(triton_chunk.TUNING)

    def use(cfg):
        triton_chunk.TUNING.clear()
        triton_chunk.TUNING.update(base, **cfg)

    rows = [{"tuning": cfg} for cfg in configs]
    for row in rows:
        use(row["tuning"])
        errs, ok = small_gate("cuda")
        row["gate_ok"], row["gate"] = ok, errs
        print(f"[gate] {json.dumps(row['tuning'])}: {'ok' if ok else 'FAILED'} "
              f"o_inf {errs['o_inference']:.1e} S_inf {errs['S_inference']:.1e}", flush=True)
    # accuracy of the inference forward against fp64
    cases = [("dense T=8192 H=4", 8192, 4, None), ("varlen T=8192 H=4", 8192, 4, VARLEN_MIX),
             ("dense T=32768 H=2", 32768, 2, None)]
    for name, T, H, lengths in cases:
        cu = None if lengths is None else cu_tensor(lengths, "cuda")
        ins = raw_inputs(1, T, H, N=None if lengths is None else len(lengths), seed=11, device="cuda", h0=True)
        with torch.no_grad():
            ref = reference_fn(ins, cu)
            for row in rows:
                use(row["tuning"])
                with prefill_at_every_size():
                    o, S = ours_fn(ins, cu)
                row.setdefault("accuracy", {})[name] = {"o": rel(o, ref[0]), "S": rel(S, ref[1])}
                print(f"[accuracy] {name} {json.dumps(row['tuning'])}: o {rel(o, ref[0]):.2e} S {rel(S, ref[1]):.2e}",
                      flush=True)
        del ref, ins
        torch.cuda.empty_cache()
    # interleaved timing of the inference forward
    for shape in ((1, 8192, 96), (1, 8192, 64)):
        fwd, _ = forward_steps(*shape, "cuda")
        key = "B={} T={} H={}".format(*shape)
        for rnd in range(args.rounds):
            for row in rows:
                if not row["gate_ok"]:
                    continue
                use(row["tuning"])
                ms = triton.testing.do_bench(fwd, warmup=10, rep=100)
                row.setdefault("fwd_ms", {}).setdefault(key, []).append(ms)
                if rnd == 0:
                    row.setdefault("fwd_kernels_ms", {})[key] = {k.split("(")[0]: v for k, (v, _) in
                                                                 kernel_times(fwd).items()}
        for row in rows:
            if row["gate_ok"]:
                t = sorted(row["fwd_ms"][key])
                kern = ", ".join(f"{k[:18]} {v:.3f}" for k, v in list(row["fwd_kernels_ms"][key].items())[:4])
                print(f"[fwd {key}] {json.dumps(row['tuning'])}: median {t[len(t) // 2]:.3f} ms {t}; {kern}",
                      flush=True)
        del fwd
        torch.cuda.empty_cache()
    use({})
    print("\nconfig | gate | fwd H=96 ms | fwd H=64 ms | o/S 8192x4 | o/S varlen | o/S 32768x2")
    for row in rows:
        def med(key):
            t = sorted(row.get("fwd_ms", {}).get(key, [float("nan")]))
            return t[len(t) // 2]
        acc = row.get("accuracy", {})
        print(f"{json.dumps(row['tuning'])} | {'ok' if row['gate_ok'] else 'FAIL'} | {med('B=1 T=8192 H=96'):.3f} | "
              f"{med('B=1 T=8192 H=64'):.3f} | " + " | ".join(f"{a['o']:.2e}/{a['S']:.2e}" for a in acc.values()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
