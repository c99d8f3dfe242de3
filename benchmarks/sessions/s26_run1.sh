#!/usr/bin/env bash
# Session 26, run 1 (one H200): the backward's fp32 intermediates in bf16 (TUNING["bwd_storage_bf16"]: the
# chunk-start states "hs" and Ũ "ut" from the training `_state`, dS_end "dse" and dŨ "du" from `_state_bwd`),
# multiplied as stored in `_bwd_vk` / `_bwd_vv` (plain bf16 products where both operands are bf16). Offline sm_90:
# `_bwd_vk` 172 → 124 KB of shared memory at 4 stages (ut, dse, du), 120 with hs; no new spills. Prediction:
# −0.4 to −0.9 ms of the 11.17 ms forward + backward at the K3 shape (~2 GB less traffic), errors within the
# issue's limits and below fla's. First the interpreter-level tests on the GPU, then every subset timed and
# its errors at T=8192 H=4 beside fla's.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s26_run1.sh
. benchmarks/sessions/prelude.sh
{
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "bf16_storage or saved_intermediates"
step 420 python3 -m benchmarks.kda --fla-cases none --cases none --accuracy --out "$OUT/s26_run1_compare.json" \
    --compare '[{}, {"bwd_storage_bf16": ["ut", "du"]}, {"bwd_storage_bf16": ["ut", "dse", "du"]},
                {"bwd_storage_bf16": ["hs", "ut", "dse", "du"]},
                {"bwd_storage_bf16": ["hs", "ut", "dse", "du"], "bwd_vk_stages": 6}, {}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
