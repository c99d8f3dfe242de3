#!/usr/bin/env bash
# Session 11, run 2 (one H200, ~7 min): the GPU tests of the MoE (Triton weight gradients) and short conv; the
# one-kernel short-conv backward at three tilings; the expert function with its weight gradients on torch vs
# "auto"; the MFU row at 4K tokens per sequence (32K per step) on this code.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s11_run2.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py -k "grouped or short_conv"
step 120 python3 -m benchmarks.short_conv --one-pass 32x64x4 64x32x4 64x64x4
step 120 python3 -m benchmarks.moe_grouped_gemm --shapes small --wgrad torch auto --out "$OUT"
step 170 python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768 \
    --seq-lens 4096 --steps 5 --json "$OUT/throughput32k.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 11000 "$OUT/log.txt"
