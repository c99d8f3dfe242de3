#!/usr/bin/env bash
# Session 11, run 5 (one H200, ~8 min): the short conv with x sliced from the small preset's 4232-element
# projection rows against rows padded to 4240 (a multiple of 16: Triton's divisibility specialisation); the fast
# paths' GPU tests and the 32K-token MFU row with the padded projection.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s11_run5.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 90 python3 -m benchmarks.short_conv --row-widths 4232 4240
step 170 python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768 \
    --seq-lens 4096 --steps 5 --json "$OUT/throughput32k.json"
step 240 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
