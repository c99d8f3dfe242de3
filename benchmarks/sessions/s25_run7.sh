#!/usr/bin/env bash
# Session 25, run 7 (one H200; the last of the device budget): the steady-state timeline of the final default at the
# K3 shape and H = 80 (one regular segment per 4096 tokens, then [0.5, 0.25]) beside the equal segments, for the figure.
#     OUT=/tmp/out bash benchmarks/sessions/s25_run7.sh
. benchmarks/sessions/prelude.sh
{
step 100 python3 benchmarks/sessions/s25_timeline.py --shapes "1,8192,96;1,8192,80" \
    --configs '[{}, {"prefill_tail_min_programs": 100000}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
cat "$OUT/log.txt" | tail -c 11000
