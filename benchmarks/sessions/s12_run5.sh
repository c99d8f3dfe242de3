#!/usr/bin/env bash
# Session 12, run 5 (one H200, < 7 min, final code): issue 5's table with fla, the KDA tests on the GPU (the
# inference forward now split bf16 at 3 stages, the few-programs rule deleted), the fast paths' GPU tests.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s12_run5.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 120 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 75 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
    -k "inference_forward or state_bwd_products or matches_fp64_recurrence or value_blocks"
step 100 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py
step 170 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
