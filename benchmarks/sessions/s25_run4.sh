#!/usr/bin/env bash
# Session 25, run 4 (one H200): segment tails at more shapes, to find where they pay (run 3: only the K3 shape gains,
# 1.321 → 1.290 ms at 2 segments + [0.5, 0.25]; H = 64 and T = 32768 H = 32 lose). Rotated, 4 rounds.
#     OUT=/tmp/out bash benchmarks/sessions/s25_run4.sh
. benchmarks/sessions/prelude.sh
{
step 400 python3 benchmarks/sessions/s22_pipeline_probe.py --rounds 4 --rotate --no-accuracy \
    --shapes "B=1 T=8192 H=96,B=1 T=8192 H=64,B=1 T=32768 H=32,B=1 T=4096 H=96,B=1 T=16384 H=96,B=1 T=8192 H=128,B=1 T=8192 H=80" \
    --out "$OUT/s25_run4_tails.json" \
    --configs '[{}, {"prefill_segment_tokens": 4096, "prefill_segment_tail": [0.5, 0.25]},
                {"prefill_segment_tokens": 4096, "prefill_segment_tail": [0.5]},
                {"prefill_segment_tokens": 4096, "prefill_segment_tail": [0.6, 0.3, 0.15]},
                {"prefill_segment_tokens": 2730, "prefill_segment_tail": [0.5, 0.25]},
                {"prefill_segment_tokens": 4096}, {"prefill_segment_tail": [0.5, 0.25]}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^\[fwd.*median" | tail -c 11500
