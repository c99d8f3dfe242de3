#!/usr/bin/env bash
# Session 11, run 6 (one H200, ~5 min): the KDA state passes' few-programs settings (TUNING["few_programs"], now
# applied by rule) against the plain defaults at the small preset's shape and at 128 programs; the KDA GPU tests.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s11_run6.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 100 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/kda-few.json" \
    --compare '[{}, {"few_programs": {}}]' --compare-shapes "8,4096,8;2,16384,16"
step 60 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "few_programs or value_blocks"
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
