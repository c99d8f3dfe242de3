#!/usr/bin/env bash
# Session 12, run 3 (one H200, < 7 min): the new defaults (`_state_bwd` split bf16 at 4 warps, 3 stages; the
# short conv's kernel 1 over 8 token blocks) on the GPU tests; more pipeline stages for the forward state
# passes and wider value blocks in the value-side backward, at the K3 and the small preset's shapes.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s12_run3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 200 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/kda-compare.json" \
    --compare '[{}, {"state_ut_stages": 3}, {"state_stages": 3}, {"bwd_vk_bv": 64}, {"bwd_vv_bv": 64}, {"bwd_vk_bv": 64, "bwd_vk_maxnreg": 168}]' \
    --compare-shapes "1,8192,96;8,4096,8"
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py -k "short_conv or conv"
step 60 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "state_bwd_products"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
