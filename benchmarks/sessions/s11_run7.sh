#!/usr/bin/env bash
# Session 11, run 7 (one H200, ~5 min): the grouped-GEMM row kernel with TMA loads beside the pointer kernel and
# torch._grouped_mm; the 32K-token MFU row on the session's final code.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s11_run7.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 150 python3 -m benchmarks.grouped_gemm_triton --shapes "small 32K" "k3 32 local" --json "$OUT/grouped_gemm_triton.json"
step 170 python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768 \
    --seq-lens 4096 --steps 5 --json "$OUT/throughput32k.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 8000 "$OUT/log.txt"
