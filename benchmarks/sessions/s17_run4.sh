#!/usr/bin/env bash
# Session 17, run 4 (one H200, < 8 min, the session's last): the MoE row spread kernel on the GPU (grouped-expert
# tests and the tiny model against the references), then the MFU table on the final code: 64K tokens per micro-batch
# at T = 4096 and 8192 and 4 micro-batches of 64K (run 2's profile stands for the step's split; no time left here).
#     OUT=/tmp/out bash benchmarks/sessions/s17_run4.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast"
{
step 90 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py -k "grouped or tiny_model"
step 110 $TP --tokens 65536 --seq-lens 4096 --steps 3 --json "$OUT/throughput64k.json"
step 80 $TP --tokens 65536 --seq-lens 4096 --steps 2 --micro-batches 4 --json "$OUT/throughput64k_mb4.json"
step 70 $TP --tokens 65536 --seq-lens 8192 --steps 2 --json "$OUT/throughput64k_8k.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^ \|^---\|^│\|^┃\|^┏\|^┡\|^└" "$OUT/log.txt" | grep -v "^\s*$" | tail -c 4000
