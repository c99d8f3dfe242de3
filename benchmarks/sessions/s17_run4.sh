#!/usr/bin/env bash
# Session 17, run 4 (one H200, < 8 min, the session's last): the MoE row spread kernel on the GPU (grouped-expert
# tests and the tiny model against the references), then the MFU table on the final code: 64K tokens per micro-batch
# at T = 4096 and 8192, 4 micro-batches of 64K, and the profile of a 64K-token step (run 2: 642 ms of kernels).
#     OUT=/tmp/out bash benchmarks/sessions/s17_run4.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast"
{
step 100 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py -k "grouped or tiny_model"
step 115 $TP --tokens 65536 --seq-lens 4096 --steps 3 --json "$OUT/throughput64k.json"
step 85 $TP --tokens 65536 --seq-lens 4096 --steps 2 --micro-batches 4 --json "$OUT/throughput64k_mb4.json"
step 70 $TP --tokens 65536 --seq-lens 8192 --steps 2 --json "$OUT/throughput64k_8k.json"
step 100 python3 benchmarks/profile_step.py --preset small --rows 16 --seq-len 4096 --steps 1 --set kda_impl=triton \
    loss_impl=triton --by-line --top 40
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^ \|^---\|^│\|^┃\|^┏\|^┡\|^└" "$OUT/log.txt" | grep -v "^\s*$" | tail -c 4000
grep -A42 "device time by k3 function (" "$OUT/log.txt" | head -44
