#!/usr/bin/env bash
# Session 15, run 5 (one H200, < 8 min): issue 5's table with fla on the final code (32-token inference chunks by
# default), the accuracy table against fp64 at T = 8192, then the prefill and GPU-file KDA tests.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s15_run5.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 220 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 100 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --accuracy --compare '[{}]' \
    --compare-shapes 1,256,2
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py \
    tests/ops/test_kda_triton.py -k "prefill or chunk_states or gpu or full or causal or split or nan"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 8000 "$OUT/log.txt"
