#!/usr/bin/env bash
# Session 16, run 1 (one H200, < 8 min): issue 9's MFU row on the current code (32K tokens per step, T = 4096,
# 1 and 4 micro-batches) and where a 32K-token step goes now (the last profile was session 11's).
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s16_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768"
{
step 150 $TP --seq-lens 4096 --steps 5 --json "$OUT/throughput32k.json"
step 100 $TP --seq-lens 4096 --steps 2 --micro-batches 4 --json "$OUT/throughput32k_mb4.json"
step 170 python3 benchmarks/profile_step.py --preset small --rows 8 --seq-len 4096 --steps 3 --set kda_impl=triton \
    loss_impl=triton --by-line --top 45
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 11000 "$OUT/log.txt"
