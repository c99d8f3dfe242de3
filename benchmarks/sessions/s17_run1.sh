#!/usr/bin/env bash
# Session 17, run 1 (one H200, < 8 min): is the step still host-bound at 64K tokens per micro-batch? Session 16
# run 2 measured 363 ms of kernels in a 425 ms step at 32K tokens (90% busy). Here: the MFU row at 64K tokens
# (T = 4096 and 8192), 64K x 2 micro-batches, and the profile of a 64K-token step (kernels busy / step).
#     OUT=/tmp/out bash benchmarks/sessions/s17_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast"
{
nvidia-smi --query-gpu=name,clocks.sm,power.draw,memory.used --format=csv
step 120 $TP --tokens 65536 --seq-lens 4096 --steps 3 --json "$OUT/throughput64k.json"
step 110 $TP --tokens 65536 --seq-lens 8192 --steps 3 --json "$OUT/throughput64k_8k.json"
step 100 $TP --tokens 65536 --seq-lens 4096 --steps 2 --micro-batches 2 --json "$OUT/throughput64k_mb2.json"
step 140 python3 benchmarks/profile_step.py --preset small --rows 16 --seq-len 4096 --steps 2 --set kda_impl=triton \
    loss_impl=triton --by-line --top 30
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
