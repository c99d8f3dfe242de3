#!/usr/bin/env bash
# Session 22, run 5 (one H200): the inference forward's dispatch rule at its edges (64 state programs at 2^19
# token-heads, 32 and 16 programs at 2^20), each shape as chunk_kda picks and forced onto the inference kernels,
# against the 64-token kernels.
#     OUT=/tmp/out bash benchmarks/sessions/s22_run5.sh
. benchmarks/sessions/prelude.sh
{
step 200 python3 benchmarks/sessions/s22_pipeline_probe.py --run5 --no-accuracy --rounds 2 \
    --out "$OUT/s22_run5_probe.json" --configs '[{}, {"prefill": false}, {"prefill_segments": 1}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 11500
