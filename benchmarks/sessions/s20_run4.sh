#!/usr/bin/env bash
# Session 20, run 4 (one H200): the grouped-GEMM table with the dense cuBLAS ceiling of the same shapes (issue 9's
# 600 TFLOP/s on the small and K3 expert shapes), then the MFU rows at T = 4096 and 8192 (64K x 4) on this code.
#     OUT=/tmp/out bash benchmarks/sessions/s20_run4.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 65536"
{
step 150 python3 -m benchmarks.moe_grouped_gemm --shapes small k3 --out "$OUT"
step 130 python3 $TP --seq-lens 4096 --steps 3 --micro-batches 4 --json "$OUT/throughput64k_mb4.json"
step 110 python3 $TP --seq-lens 8192 --steps 3 --micro-batches 4 --json "$OUT/throughput64k_8k_mb4.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^ \|^---\|^│\|^┃\|^┏\|^┡\|^└" "$OUT/log.txt" | grep -v "^\s*$" | tail -c 9000
grep "^│\|^┃" "$OUT/log.txt" | tail -12
