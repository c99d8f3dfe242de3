#!/usr/bin/env bash
# Session 26, run 4 (one H200): launch settings the bf16 tiles of the value-side backward allow (offline sm_90):
# `_bwd_vk` on value blocks of 64 (two loop steps with 64-deep products: 240 registers, no spills, 152 KB at 3
# stages, 192 at 4), `_bwd_vv` at 4 stages (104 KB, still two per SM) and on value blocks of 64 at 2 stages
# (128 registers, 40 B of spills). Each gated against fp64, then timed at the K3 shape and the small preset's.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s26_run4.sh
. benchmarks/sessions/prelude.sh
{
step 400 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/s26_run4_compare.json" \
    --compare-shapes "1,8192,96;4,4096,8" \
    --compare '[{}, {"bwd_vk_bv": 64, "bwd_vk_stages": 3}, {"bwd_vk_bv": 64, "bwd_vk_stages": 4},
                {"bwd_vv_stages": 4}, {"bwd_vv_bv": 64, "bwd_vv_stages": 2}, {}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
