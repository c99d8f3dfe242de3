#!/usr/bin/env bash
# Session 28, run 2 (one H200): run 1's `_bwd_finish` lost (1.15 ms against 0.80 for the two launches) and is
# reverted. The training state passes alone under settings that give two programs per SM (s28_state_probe.py);
# then, timed and measured against fp64 beside the defaults: the training forward's o apart from `_state`
# (`state_o_apart`, `_fwd_o`), with `_state` at 2 stages (two programs per SM), and bf16 scratch.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s28_run2.sh
. benchmarks/sessions/prelude.sh
{
step 60 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "output_apart"
step 150 python3 benchmarks/sessions/s28_state_probe.py --out "$OUT/s28_state_probe.json"
step 240 python3 -m benchmarks.kda --fla-cases none --cases none --accuracy --out "$OUT/s28_run2_compare.json" \
    --compare '[{}, {"bwd_scratch_bf16": true}, {"state_o_apart": true}, {"state_o_apart": true, "state_ut_stages": 2},
                {"state_o_apart": true, "state_ut_stages": 2, "fwd_o_bv": 128},
                {"state_o_apart": true, "state_ut_stages": 2, "bwd_scratch_bf16": true}, {}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
