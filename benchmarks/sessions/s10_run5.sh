#!/usr/bin/env bash
# Session 10, run 5 (one H200, ~4 min): the tests run 4 failed or did not reach, on the fixed code: the KDA
# inference-forward test, the fused two-phase AttnRes at full shapes, and the rest of the fast paths' GPU tests.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s10_run5.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 40 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "inference_forward"
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py \
    -k "two_phase or mla or tiny_model or cross_entropy or short_conv or host_token"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 6000 "$OUT/log.txt"
