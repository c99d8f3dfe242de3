#!/usr/bin/env bash
# Session 27, run 1 (one H200): dAkk = −Tᵀ·(dŨ·Ũᵀ) in `_bwd_vv` (no key-side dT partials, §7 item 57) against
# session 26's code (a copy of 9b05d0b carried in .var/base), then dA stored in bf16 (`bwd_da_bf16`) and
# `_bwd_vv` launches the lighter kernel may prefer, each gated against fp64 (--accuracy).
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s27_run1.sh
. benchmarks/sessions/prelude.sh
{
step 150 bash -c "cd .var/base && PYTHONPATH=/tmp/site:\$PWD python3 -m benchmarks.kda --fla-cases none --cases none \
    --out $OUT/s27_run1_base.json --compare '[{}]'"
step 400 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/s27_run1_compare.json" --accuracy \
    --compare '[{}, {"bwd_da_bf16": true}, {"bwd_vv_bv": 64, "bwd_vv_stages": 2}, {"bwd_vv_warps": 4}, {}]'
step 150 bash -c "cd .var/base && PYTHONPATH=/tmp/site:\$PWD python3 -m benchmarks.kda --fla-cases none --cases none \
    --out $OUT/s27_run1_base2.json --compare '[{}]'"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
