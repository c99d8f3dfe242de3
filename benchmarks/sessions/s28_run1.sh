#!/usr/bin/env bash
# Session 28, run 1 (one H200): `_bwd_finish` (`_bwd_gate` + `_bwd_norms` in one launch per (chunk, head), the new
# default) against the two launches, its launch knobs, and launch variants not timed since session 26 (bf16 scratch,
# the state passes on value blocks of 64), gated against fp64 at small shapes first.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s28_run1.sh
# (ran at 9a67b5a; `bwd_finish` and `_bwd_finish` were deleted in 7d2e4dd, so later code refuses its TUNING keys)
. benchmarks/sessions/prelude.sh
{
step 60 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "finish_in_one or bf16_storage"
step 300 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/s28_run1_compare.json" \
    --compare '[{}, {"bwd_finish": false}, {"bwd_finish_warps": 4}, {"bwd_finish_warps": 16}, {"bwd_gate_cols": 64},
                {"bwd_scratch_bf16": true}, {"state_ut_bv": 64}, {"state_ut_bv": 64, "state_ut_warps": 8},
                {"state_bwd_bv": 64}, {}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
