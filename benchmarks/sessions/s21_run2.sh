#!/usr/bin/env bash
# Session 21, run 2 (one H200): issue 5's inference forward, storage and product variants (U in bf16, a tf32
# inverse, bf16 state products; 16- and 32-token chunks) timed interleaved with their fp64 errors; then the training
# prepare's inverse in tf32 (fwd+bwd and the fp64 accuracy table).
#     OUT=/tmp/out bash benchmarks/sessions/s21_run2.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 330 python3 benchmarks/sessions/s21_prefill_probe.py --out "$OUT/s21_prefill_probe.json"
step 200 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --accuracy \
    --compare '[{}, {"prep_inverse": "tf32"}]' --out "$OUT/s21_prep_inverse.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 11500
