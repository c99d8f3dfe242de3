#!/usr/bin/env bash
# Session 9, run 3 (one H200, < 10 min): the KDA compare of run 2 (lost to a quoting bug there) — the split-bf16 state
# passes against tf32 and the launch settings the Nsight Compute analysis pointed at — and the GPU tests of the
# changes (split state products, the cross-entropy weight gradient summed in the GEMM).
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out COMPARE='[{}, …]' COMPARE_SMALL='[{}, …]' bash benchmarks/sessions/s9_run3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if [ -z "${COMPARE:-}" ]; then COMPARE='[{}]'; fi
if [ -z "${COMPARE_SMALL:-}" ]; then COMPARE_SMALL='[{}]'; fi
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 100 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py -k "cross_entropy"
step 280 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/compare.json" --compare "$COMPARE"
step 120 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/compare_small.json" \
    --compare-shapes "4,4096,8" --compare "$COMPARE_SMALL"
} 2>&1 | grep -v "Warning\|warn_once" | tee "$OUT/log.txt"
