#!/usr/bin/env bash
# Session 25, run 2 (one H200): the inference pipeline's timeline (which kernel runs when, on which stream) at the
# K3 shape and H = 64 for the equal and the tapered segments, then segment counts with and without a tail, rotated.
#     OUT=/tmp/out bash benchmarks/sessions/s25_run2.sh
. benchmarks/sessions/prelude.sh
{
step 120 python3 benchmarks/sessions/s25_timeline.py --shapes "1,8192,96;1,8192,64" \
    --configs '[{}, {"prefill_segments": 3, "prefill_segment_tail": [0.5, 0.2]}, {"prefill_segments": 1}]'
step 240 python3 benchmarks/sessions/s22_pipeline_probe.py --rounds 5 --rotate --no-accuracy \
    --shapes "B=1 T=8192 H=96,B=1 T=8192 H=64,B=1 T=32768 H=32" --out "$OUT/s25_run2_segments.json" \
    --configs '[{}, {"prefill_segments": 3}, {"prefill_segments": 3, "prefill_segment_tail": [0.5]},
                {"prefill_segments": 3, "prefill_segment_tail": [0.5, 0.2]}, {"prefill_segments": 2},
                {"prefill_segments": 2, "prefill_segment_tail": [0.5, 0.25]},
                {"prefill_segment_tokens": 2730, "prefill_segment_tail": [0.5, 0.2]}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^\[fwd.*median" | tail -c 30000
