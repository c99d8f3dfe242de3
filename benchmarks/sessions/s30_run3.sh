#!/usr/bin/env bash
# Session 30, run 3 (one H200), prepared in session 30 (no device lent then either). The norm backward's and dβ's sums
# over K from the scores (`norms_from_scores`, docs/kda-kernels.md §7 item 69: Euler's identity in `_bwd_vv` on the
# prepare's Ã, `_bwd_k_block` writing dq and dk, no `_bwd_norms`): its GPU test first (`_bwd_k_block`'s tf32 score
# products against the Euler sums on the stored scores are what the interpreter, exact in fp32, does not show), then
# timed and measured against fp64 beside the defaults, alone and with Q′ (`state_bwd_qprime`, which loads Aqk in
# `_bwd_vv` already), at the K3 shape and the small preset's. Prediction: −0.33 ms (`_bwd_norms`) + ~0.03 (the
# prepare's bf16 Ã store, 100 MB) + ~0.08 (`_bwd_vv` reading Ã and Aqk, 300 MB, 8 B of spills at its 128-register
# cap offline): −0.2 ms at the K3 shape. `_bwd_k_block`'s spills grow 112 → 148/160 B at its 64-register cap offline
# (104 at 80, six programs per SM instead of eight) and `_bwd_vv`'s 0 → 8 B at 128 (none at 168): a row each.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s30_run3.sh
. benchmarks/sessions/prelude.sh
{
step 140 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "norm_sums_from_scores"
step 430 python3 -m benchmarks.kda --fla-cases none --cases none --fla-configs 1 --accuracy \
    --out "$OUT/s30_run3_compare.json" \
    --compare '[{}, {"norms_from_scores": true}, {"norms_from_scores": true, "bwd_k_maxnreg": 80},
                {"norms_from_scores": true, "bwd_vv_maxnreg": 168},
                {"norms_from_scores": true, "state_bwd_qprime": true}, {}]' \
    --compare-shapes '1,8192,96;4,4096,8'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
