#!/usr/bin/env bash
# Session 28, run 2 (one H200): run 1's `_bwd_finish` lost (1.15 ms against 0.80 for the two launches) and is
# reverted. The training state passes alone under settings that give two programs per SM (s28_state_probe.py),
# then bf16 scratch (`bwd_scratch_bf16`) timed and measured against fp64 beside the defaults.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s28_run2.sh
. benchmarks/sessions/prelude.sh
{
step 150 python3 benchmarks/sessions/s28_state_probe.py --out "$OUT/s28_state_probe.json"
step 200 python3 -m benchmarks.kda --fla-cases none --cases none --accuracy --out "$OUT/s28_run2_compare.json" \
    --compare '[{}, {"bwd_scratch_bf16": true}, {}, {"bwd_scratch_bf16": true}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
