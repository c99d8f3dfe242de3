#!/usr/bin/env bash
# Session 16, run 3 (one H200, < 9 min): the fast paths' GPU tests to the end (run 2 cut them at 110 s on a cold
# machine), then the MFU row at 64K tokens per micro-batch (run 2's step was host-bound: kernels busy 90% at 32K)
# and with 4 micro-batches of 32K tokens per optimizer step.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s16_run3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --seq-lens 4096"
{
step 210 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py
step 140 $TP --tokens 65536 --steps 3 --json "$OUT/throughput64k.json"
step 140 $TP --tokens 32768 --steps 2 --micro-batches 4 --json "$OUT/throughput32k_mb4.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 6000 "$OUT/log.txt"
