#!/usr/bin/env bash
# Session 21, run 1 (one H200): a persistent Triton grouped GEMM for the routed experts' row GEMMs (TMA
# descriptors, with and without warp specialisation) against torch._grouped_mm and dense cuBLAS.
#     OUT=/tmp/out bash benchmarks/sessions/s21_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 420 env PYTHONPATH=. python3 benchmarks/sessions/s21_grouped_rows_probe.py --out "$OUT/s21_grouped_rows.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 11500
