#!/usr/bin/env bash
# Session 11, run 1 (one H200, ~5 min): the routed experts' six grouped GEMMs, torch._grouped_mm against the
# Triton kernels of k3.ops.grouped_gemm at several tile configs; the short conv's two program orders.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s11_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 300 python3 -m benchmarks.grouped_gemm_triton --json "$OUT/grouped_gemm_triton.json"
step 90 python3 -m benchmarks.short_conv --grid both
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
