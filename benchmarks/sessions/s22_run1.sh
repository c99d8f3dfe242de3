#!/usr/bin/env bash
# Session 22, run 1 (one H200): issue 5's inference forward as a pipeline of segments (prefill_segments), timed
# interleaved at the inference shapes with bit-identity checks; then the GPU tests of the pipeline.
#     OUT=/tmp/out bash benchmarks/sessions/s22_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 330 python3 benchmarks/sessions/s22_pipeline_probe.py --out "$OUT/s22_pipeline_probe.json"
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "segment or pipeline"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 11500
