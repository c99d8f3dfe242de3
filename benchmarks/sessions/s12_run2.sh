#!/usr/bin/env bash
# Session 12, run 2 (one H200, < 9 min): the new `_state_bwd` default (split-bf16 products, 4 warps, 2 stages)
# on the KDA GPU tests, against the old one (tf32, 8 warps, 1 stage) at 128 programs, its stage count at the K3
# and the small preset's shapes; the short conv's backward kernel 1 over several token blocks per program.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s12_run2.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 100 python3 -m benchmarks.short_conv --quick --bwd-tiles 32x64x4 16x64x8x8 16x64x8x8x2 16x64x8x8x3 \
    16x64x8x32x2 32x64x8x4 32x64x8x4x2 16x64x4x8 8x64x4x8x2 16x128x8x8x2
step 60 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_short_conv.py -k fused_backward
step 90 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/kda-128.json" \
    --compare '[{}, {"state_bwd_products": "tf32", "state_bwd_warps": 8, "state_bwd_stages": 1}]' \
    --compare-shapes "2,16384,16;1,32768,32"
step 90 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/kda-stages.json" \
    --compare '[{"state_bwd_stages": 1}, {"state_bwd_stages": 3}]' --compare-shapes "1,8192,96;8,4096,8"
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
    -k "state_bwd or few_programs or value_blocks or matches_fp64 or key_slices or saved_intermediates"
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
