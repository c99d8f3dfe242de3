"""Session 28 probe (issue 5): how much of the training state passes' time is their one program per SM.

The training forward's `_state` (o, chunk-start states and Ũ) takes 216 KB of shared memory at 3 stages and
`_state_bwd` 204 KB (`benchmarks/kda_spills.py`), so each runs one 4-warp program per SM, in three waves of the
384 (value block, sequence, head) programs at the K3 shape. This times each launch alone at B=1 T=8192 H=96 under
settings that change that: without o (128 KB at 3 stages, ~85 KB at 2: two programs per SM), at 2 stages, on
value blocks of 64 (192 programs). Medians of `triton.testing.do_bench`.

    PYTHONPATH=. python3 benchmarks/sessions/s28_state_probe.py --out /tmp/probe.json
"""
from __future__ import annotations

import json

import torch
import triton

from benchmarks.kda import chunk_operands, probe_setup
from k3.ops.kda import triton_chunk as tc
from k3.ops.kda.triton_common import backward_storage


def main() -> None:
    args, (B, T, H), dev = probe_setup("each launch run once")
    plan, h0, (W, U, Qg, Kd, Aqk, gc, *_) = chunk_operands(B, T, H, device=dev)
    hs_dt, ut_dt = backward_storage(torch.bfloat16, "hs"), backward_storage(torch.bfloat16, "ut", U.dtype)
    base = dict(tc.TUNING)
    rows = []

    def timed(name, cfg, fn):
        tc.TUNING.clear()
        tc.TUNING.update(base, **cfg)
        try:
            fn()
            ms = 0.0 if args.quick else triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
        except triton.runtime.errors.OutOfResources as e:
            ms, cfg = float("nan"), dict(cfg, refused=str(e)[:80])
        finally:
            tc.TUNING.clear()
            tc.TUNING.update(base)
        rows.append({"launch": name, "tuning": cfg, "ms": ms})
        print(f"{name:34s} {json.dumps(cfg):70s} {ms:7.3f} ms", flush=True)

    def fwd_state(write_o):
        return lambda: tc._fwd_state(W, U, Qg, Kd, Aqk, gc, h0, plan, torch.bfloat16, write_o=write_o,
                                     want_hs=True, want_ut=True, training=True, hs_dtype=hs_dt, ut_dtype=ut_dt)

    for cfg in ({}, {"state_ut_stages": 2}, {"state_ut_bv": 64, "state_ut_stages": 2},
                {"state_ut_bv": 64, "state_ut_warps": 8, "state_ut_stages": 2}):
        timed("_state: o, states, U~ (training)", cfg, fwd_state(True))
    # (1 stage, also tried in run 2, ended the process with an illegal address: docs/kda-kernels.md §6 session 28)
    for cfg in ({}, {"state_ut_stages": 2}, {"state_ut_bv": 64, "state_ut_stages": 2},
                {"state_ut_bv": 64, "state_ut_warps": 8, "state_ut_stages": 2}):
        timed("_state: states, U~ (no o)", cfg, fwd_state(False))
    timed("_state: o only (inference)", {}, lambda: tc._fwd_state(W, U, Qg, Kd, Aqk, gc, h0, plan, torch.bfloat16,
                                                                  want_ht=True))
    do = torch.randn(B * T, H, 128, device=dev, generator=torch.Generator(dev).manual_seed(6)).bfloat16()
    du = torch.empty(B * T, H, 128, dtype=backward_storage(torch.bfloat16, "du"), device=dev)
    dse = torch.empty(plan.NT, H, 128, 128, dtype=backward_storage(torch.bfloat16, "dse"), device=dev)
    dh0 = torch.empty(plan.N, H, 128, 128, device=dev)

    def state_bwd():
        BV = tc.TUNING["state_bwd_bv"]
        tc._state_bwd[(128 // BV, plan.N * H)](Qg, Kd, Aqk, W, gc, do, dh0, du, dse, dh0, plan.cu, plan.chunk_off,
                                               H=H, K=128, V=128, BV=BV, C=tc.CHUNK, USE_DHT=False, BF16=False,
                                               SPLIT=True, QPRIME=False, INTERP=dev == "cpu",
                                               **tc._launch_options("state_bwd"))

    for cfg in ({}, {"state_bwd_stages": 2}, {"state_bwd_bv": 64, "state_bwd_stages": 2}):
        timed("_state_bwd", cfg, state_bwd)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": {"B": B, "T": T, "H": H}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
