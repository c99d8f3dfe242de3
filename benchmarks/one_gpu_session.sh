#!/usr/bin/env bash
# One H200, under ten minutes: the new fast paths' GPU tests, then the measurements of issues 9 and 5.
# Each step has its own time limit so that a slow one cannot take the others' time; results go to $OUT
# (or benchmarks/results when OUT is unset). Run from the repository root:
#     OUT=/tmp/out bash benchmarks/one_gpu_session.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }

step 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fast_paths.py -k "chunked or short_conv or grouped"
step 40 python3 -m benchmarks.short_conv
step 70 python3 -m benchmarks.cross_entropy
# issue 9: MFU at 4K and 8K, reference ops vs fast, checkpointing on both; then the 50-step loss comparison
step 300 python3 benchmarks/train_throughput.py --presets small --seq-lens 4096 8192 --tokens 16384 \
    --kda-impl triton --variants reference fast --ckpt --loss-steps 50 --loss-tokens 4096 --time-budget 200 \
    --json "$OUT/throughput.json"
# issue 5: the two main KDA shapes against fla (one config per fla autotuner: a full autotune takes minutes)
step 100 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96" --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96"
