#!/usr/bin/env bash
# Session 20, run 2 (one H200): weight gradients added into .grad where they are computed (k3.ops.weight_grads),
# on against off in one process (benchmarks/step_ab.py); the GPU tests that take its paths (the grouped experts,
# the tiny model's fast stack, a train step without host waits; the expert kernel in the interpreter file's
# GPU twin); then the MFU rows at T = 4096, 64K x 4 and 64K x 8 micro-batches.
#     OUT=/tmp/out bash benchmarks/sessions/s20_run2.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 65536"
{
step 230 python3 -m benchmarks.step_ab --seq-len 4096 --tokens 65536 --micro-batches 4 --rounds 6 \
    --settings "" "weight_grads.OPTIONS.in_place=False" --json "$OUT/ab4096_weight_grads.json"
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py tests/ops/test_weight_grads.py \
    -k "grouped or tiny_model or host_token or weight_grads or helpers or micro_batches or in_place"
step 110 python3 $TP --seq-lens 4096 --steps 3 --micro-batches 4 --json "$OUT/throughput64k_mb4.json"
step 110 python3 $TP --seq-lens 4096 --steps 2 --micro-batches 8 --json "$OUT/throughput64k_mb8.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^ \|^---\|^│\|^┃\|^┏\|^┡\|^└" "$OUT/log.txt" | grep -v "^\s*$" | tail -c 9000
grep "^│\|^┃" "$OUT/log.txt" | tail -12
