#!/usr/bin/env bash
# Session 10, run 4 (one H200, < 10 min, final code): the KDA tests at full shapes and the new inference-forward
# test, the fast paths' GPU tests (the fused two-phase AttnRes included), issue 5's table with fla, and the MFU
# row at 8K tokens per sequence. Log: $OUT/log.txt; the KDA table JSON: $OUT/kda.json.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s10_run4.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py
step 40 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
    -k "inference_forward or state_split or matches_fp64_recurrence"
step 90 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py
step 170 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 90 python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768 \
    --seq-lens 8192 --steps 3 --json "$OUT/throughput32k-8k.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
