#!/usr/bin/env bash
# Session 10, run 3 (one H200, ~5 min): the second form of the fused two-phase AttnRes (row statistics + chunk
# tiles): its block benchmark against the fused direct read, its GPU tests, the 32K-token step with it ("auto")
# and with the fused direct read, back to back in one process each. Log: $OUT/log.txt.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s10_run3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768"
{
step 60 python3 -m benchmarks.attn_res
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py -k "attn_res or tiny_model"
step 110 $TP --seq-lens 4096 --steps 8 --json "$OUT/throughput32k-two-phase.json"
step 70 $TP --seq-lens 4096 --steps 8 --set attn_res_impl=triton --json "$OUT/throughput32k-direct.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 6000 "$OUT/log.txt"
