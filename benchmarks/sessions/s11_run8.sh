#!/usr/bin/env bash
# Session 11, run 8 (one H200, ~4 min): the fast paths' and the KDA kernels' GPU tests on the session's final code.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s11_run8.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py
step 100 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 5000 "$OUT/log.txt"
