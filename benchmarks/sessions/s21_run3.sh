#!/usr/bin/env bash
# Session 21, run 3 (one H200): issue 5's table with fla (one config per autotuner) on this code's defaults, then the
# prefill tests on the GPU. Needs fla-core's wheel in .whl (docs/kda-kernels.md §6) and carry: [".whl"].
#     OUT=/tmp/out bash benchmarks/sessions/s21_run3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 240 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py \
    tests/ops/test_kda_triton.py -k "prefill or chunk_states or gpu or full or causal or split or nan"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
