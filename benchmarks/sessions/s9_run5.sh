#!/usr/bin/env bash
# Session 9, run 5 (one H200, < 6 min): flex attention's backward launch options at the small preset's MLA shape
# (its backward ran at ~150 TFLOP/s in run 2's profile), then the 32K-token MFU row on this session's final code.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s9_run5.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 190 python3 benchmarks/flex_options.py --options '[{},
 {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "bwd_num_stages": 3, "bwd_num_warps": 4},
 {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "bwd_num_stages": 2, "bwd_num_warps": 8},
 {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "bwd_num_stages": 3, "bwd_num_warps": 4}]'
step 150 python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768 \
    --seq-lens 4096 --steps 5 --json "$OUT/throughput32k.json"
} 2>&1 | grep -v "Warning\|warn_once" | tee "$OUT/log.txt"
