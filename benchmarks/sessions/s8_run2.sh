#!/usr/bin/env bash
# Session 8, run 2: where the small preset's step goes with the gate pre-pass and the split value-side backward
# as KDA defaults, and the MFU table at 16K and 32K tokens per step.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 110 python3 benchmarks/profile_step.py --preset small --rows 4 --seq-len 4096 --set kda_impl=triton \
    loss_impl=triton --by-line --top 25
step 60 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/compare_small.json" \
    --compare-shapes "2,8192,8;4,4096,8;4,8192,8" --compare '[{}, {"state_warps": 8}]'
step 170 python3 benchmarks/train_throughput.py --presets small --seq-lens 4096 8192 --tokens 16384 --steps 2 \
    --kda-impl triton --variants fast --time-budget 150 --json "$OUT/throughput16k.json"
step 170 python3 benchmarks/train_throughput.py --presets small --seq-lens 4096 8192 --tokens 32768 --steps 2 \
    --kda-impl triton --variants fast --time-budget 150 --json "$OUT/throughput32k.json"
} 2>&1 | grep -v "Warning\|warn_once" | tee "$OUT/log.txt"
