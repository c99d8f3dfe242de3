#!/usr/bin/env bash
# Session 27, run 2 (one H200): the backward reordered (`_bwd_vv` → `_bwd_k_block` → `_bwd_vk`, which adds the
# score side's part and does the reverse cumsum and gate chain: no `_bwd_gate`, §7 item 59) with bf16 dA and
# `_bwd_vv` on value blocks of 64 as defaults; launch variants the new kernels may prefer; then issue 5's
# forward + backward row against fla* with the accuracy table.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s27_run2.sh
. benchmarks/sessions/prelude.sh
{
step 240 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/s27_run2_compare.json" \
    --compare '[{}, {"bwd_k_maxnreg": 64}, {"bwd_scratch_bf16": true}, {"bwd_vk_stages": 4}, {"bwd_vk_bv": 32, "bwd_vk_stages": 4}, {}]'
step 200 python3 -m benchmarks.kda --fla-configs 1 --accuracy --out "$OUT/kda.json" --cases "fwd+bwd" \
    --fla-cases "fwd+bwd B=1 T=8192 H=96"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
