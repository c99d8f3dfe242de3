#!/usr/bin/env bash
# Session 8, MFU run: the small preset's step at 32K, 64K and 16K tokens per micro-batch (5 timed steps, the
# median: two-step medians spread by 0.85 vs 0.51 s in run 2), 4 micro-batches of 32K per optimizer step, and
# where an 8K-token step goes (session 6's profile shape; its device-busy share says whether the host binds).
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast"
{
step 120 $TP --seq-lens 4096 8192 --tokens 32768 --steps 5 --time-budget 100 --json "$OUT/throughput32k.json"
step 75 $TP --seq-lens 4096 --tokens 65536 --steps 3 --json "$OUT/throughput64k.json"
step 75 $TP --seq-lens 4096 --tokens 32768 --steps 2 --micro-batches 4 --json "$OUT/throughput32k_mb4.json"
step 90 $TP --seq-lens 4096 8192 --tokens 16384 --steps 5 --time-budget 70 --json "$OUT/throughput16k.json"
step 140 python3 benchmarks/profile_step.py --preset small --rows 2 --seq-len 4096 --steps 2 --set kda_impl=triton \
    loss_impl=triton --by-line --top 20
} 2>&1 | grep -v "Warning\|warn_once" | tee "$OUT/log.txt"
