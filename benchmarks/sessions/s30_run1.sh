#!/usr/bin/env bash
# Session 30, run 1 (one H200), prepared in sessions 28-29 (session 29 had no device). `_state_bwd` on Q′ (without
# Aqk's tile and product, docs/kda-kernels.md §7 item 65) alone against the default pass at the K3 shape; then the
# whole switch (`state_bwd_qprime`: Q′ from `_prep_wu`, dŨ's Aqkᵀ·dO in `_bwd_vk` and `_bwd_vv`) timed and measured
# against fp64 beside the defaults, with `_bwd_vv`'s launches that spill less under it (offline: 84 B at the
# 128-register cap, 4 B at 168, none at BV 32 uncapped), at the K3 shape and the small preset's (B=4 T=4096 H=8;
# `_fwd_o` moved to split products after session 28's last timing, re-timed here by the default rows). fla keeps one
# autotune config (the accuracy table's fla columns; fully autotuned, --accuracy ran past its limit in sessions 26-28).
# The GPU tests of the switch are run 2's.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s30_run1.sh
. benchmarks/sessions/prelude.sh
{
step 120 python3 benchmarks/sessions/s30_state_bwd_probe.py --out "$OUT/s30_state_bwd_probe.json"
step 360 python3 -m benchmarks.kda --fla-cases none --cases none --fla-configs 1 --accuracy \
    --out "$OUT/s30_run1_compare.json" \
    --compare '[{}, {"state_bwd_qprime": true}, {"state_bwd_qprime": true, "bwd_vv_maxnreg": 168},
                {"state_bwd_qprime": true, "bwd_vv_bv": 32, "bwd_vv_maxnreg": null}, {}]' \
    --compare-shapes '1,8192,96;4,4096,8'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
