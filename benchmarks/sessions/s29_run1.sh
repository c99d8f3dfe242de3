#!/usr/bin/env bash
# Session 29, run 1 (one H200), prepared in session 28: `_state_bwd` in the Q′ form (without Aqk's tile and product,
# docs/kda-kernels.md §8 "Status after session 28") against the library kernel, checked and timed at the K3 shape;
# then the defaults timed and measured against fp64 (`_fwd_o` moved to split products after session 28's last timing),
# also at the small preset's KDA shape (B=4 T=4096 H=8, not re-timed in session 28), and the tests of `_fwd_o` on the GPU.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s29_run1.sh
. benchmarks/sessions/prelude.sh
{
step 150 python3 benchmarks/sessions/s29_state_bwd_probe.py --out "$OUT/s29_state_bwd_probe.json"
step 200 python3 -m benchmarks.kda --fla-cases none --cases none --accuracy --out "$OUT/s29_run1_compare.json" \
    --compare '[{}, {"state_o_apart": false}, {}]' --compare-shapes '1,8192,96;4,4096,8'
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
    -k "saved_intermediates_match or output_apart or bf16_storage"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 11500
