#!/usr/bin/env bash
# Session 24, run 3 (one H200; the session's last device time): the final code's KDA GPU tests (`_bwd_vk` loading
# T, G, q̂ and k̂ before its value loop; the inference state pass back at BV 64), issue 5's table with fla, then the
# pipeline's register budget, rotated per round: a state program at 168 registers leaves its SM room for one
# prepare program of 96 beside a second state program, for two at 88 (8 B of spills offline) or 80 (64 B); the
# state pass at 144 (40 B) leaves room for two beside two. Last, `_bwd_vk`'s stages now that its loads come early.
#     OUT=/tmp/out bash benchmarks/sessions/s24_run3.sh
. benchmarks/sessions/prelude.sh
{
step 200 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py \
    tests/ops/test_kda_triton.py -k "key_slices or fp64 or kept_norms or saved or prefill or head_dims or causality"
step 120 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 150 python3 benchmarks/sessions/s22_pipeline_probe.py --rounds 4 --rotate --no-accuracy \
    --out "$OUT/s24_run3_probe.json" --configs '[{}, {"prefill_prepare_maxnreg": 88}, {"prefill_prepare_maxnreg": 80},
                                               {"prefill_state_maxnreg": 144}]'
step 90 python3 -m benchmarks.kda --fla-cases none --cases none \
    --compare '[{}, {"bwd_vk_stages": 2}, {"bwd_vk_stages": 4}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^│\|^┃\|^┏\|^┡\|^└" | grep -v "^\[fwd.*median" | tail -c 11500
