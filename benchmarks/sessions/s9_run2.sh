#!/usr/bin/env bash
# Session 9, run 2 (one H200, < 10 min): the split-bf16 state passes against tf32 (docs/kda-kernels.md §7), launch
# settings the Nsight Compute run pointed at, then where a 32K-token training step of the small preset goes.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s9_run2.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 90 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "state_split or state_value_blocks"
step 240 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/compare.json" --compare "${COMPARE:-[{}]}"
step 100 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/compare_small.json" \
    --compare-shapes "4,4096,8" --compare "${COMPARE_SMALL:-[{}]}"
step 150 python3 benchmarks/profile_step.py --preset small --rows 8 --seq-len 4096 --steps 2 --set kda_impl=triton \
    loss_impl=triton --by-line --top 25
} 2>&1 | grep -v "Warning\|warn_once" | tee "$OUT/log.txt"
