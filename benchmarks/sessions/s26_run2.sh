#!/usr/bin/env bash
# Session 26, run 2 (one H200): the KDA GPU tests under run 1's winners as defaults (all four backward
# intermediates in bf16, `_bwd_vk` at 6 stages; fp32 inputs keep fp32 tiles at 4 stages), fla on the same inputs for
# the 1.5× error check; then the scratch dq̂, dk̂ in bf16 (`bwd_scratch_bf16`: half of their 3.2 GB of traffic,
# prediction −0.2 to −0.3 ms), `_bwd_vk` at 8 stages, and hs back in fp32 (the states' share of the gain and of
# dA_log's error), each timed and its errors at T=8192 H=4 beside fla's.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s26_run2.sh
. benchmarks/sessions/prelude.sh
{
step 300 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py tests/ops/test_kda_triton.py
step 280 python3 -m benchmarks.kda --fla-cases none --cases none --accuracy --out "$OUT/s26_run2_compare.json" \
    --compare '[{}, {"bwd_scratch_bf16": true}, {"bwd_vk_stages": 8}, {"bwd_storage_bf16": ["ut", "dse", "du"]}, {}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
