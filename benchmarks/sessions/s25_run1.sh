#!/usr/bin/env bash
# Session 25, run 1 (one H200): the KDA GPU tests with `_bwd_vk` at 4 stages (the new default) and the pipeline's
# shorter tail segments (`prefill_segment_tail`, bit-identical results); then the tails timed at the pipelined
# shapes, rotated per round, and `_bwd_vk`'s stages once more in the forward+backward.
#     OUT=/tmp/out bash benchmarks/sessions/s25_run1.sh
. benchmarks/sessions/prelude.sh
{
step 220 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py \
    tests/ops/test_kda_triton.py -k "key_slices or fp64 or kept_norms or saved or prefill or head_dims or causality or segment"
step 200 python3 benchmarks/sessions/s22_pipeline_probe.py --rounds 5 --rotate --no-accuracy \
    --shapes "B=1 T=8192 H=96,B=1 T=8192 H=64,B=1 T=32768 H=32" --out "$OUT/s25_run1_tail.json" \
    --configs '[{}, {"prefill_segment_tail": [0.5]}, {"prefill_segment_tail": [0.25]},
                {"prefill_segment_tail": [0.5, 0.25]}, {"prefill_segment_tail": [0.6, 0.3, 0.15]},
                {"prefill_segment_tail": [0.4, 0.15]}, {"prefill_segments": 3, "prefill_segment_tail": [0.5, 0.2]}]'
step 90 python3 -m benchmarks.kda --fla-cases none --cases none \
    --compare '[{"bwd_vk_stages": 3}, {"bwd_vk_stages": 4}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^│\|^┃\|^┏\|^┡\|^└" | grep -v "^\[fwd.*median" | tail -c 11500
