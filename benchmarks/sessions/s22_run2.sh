#!/usr/bin/env bash
# Session 22, run 2 (one H200): issue 5's inference forward at the new defaults (16-token chunks beyond 64 state
# programs, 32-token chunks at or below, both as 4-segment pipelines within one wave; the inference kernels from 64
# programs), timed interleaved with variants at few programs (the small preset's H = 8); the training forward and
# the backward as pipelines (state_segments, state_bwd_segments) at the K3 shape and the small preset's; the GPU
# tests of both pipelines.
#     OUT=/tmp/out bash benchmarks/sessions/s22_run2.sh
. benchmarks/sessions/prelude.sh
{
step 150 python3 benchmarks/sessions/s22_pipeline_probe.py --run2 --rounds 2 --out "$OUT/s22_run2_probe.json" \
    --configs '[{}, {"prefill": false}, {"prefill_segments": 8}, {"prefill_state_bv": 32},
                {"prefill_chunk32_max_programs": 32}]'
step 250 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/s22_run2_compare.json" \
    --compare-shapes "1,8192,96;4,4096,8" --compare '[{}, {"state_segments": 4}, {"state_bwd_segments": 4},
    {"state_segments": 4, "state_bwd_segments": 4}, {"state_segments": 4, "state_bwd_segments": 8}]'
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
    tests/gpu/test_kda_triton_gpu.py -k "prefill or pipeline or segment"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 11500
