#!/usr/bin/env bash
# Session 21, run 3 (one H200): the scores folded into the 16-token prepare (`prefill_fold`) against the new
# defaults, interleaved, with their fp64 errors; then issue 5's table with fla (one config per autotuner) under the
# fastest setting whose inference error stays ≤ 4.5e-3 everywhere; then the prefill tests on the GPU. Needs
# fla-core's wheel in .whl (docs/kda-kernels.md §6) and carry: [".whl"].
#     OUT=/tmp/out bash benchmarks/sessions/s21_run3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 150 python3 benchmarks/sessions/s21_prefill_probe.py --rounds 3 --out "$OUT/s21_fold_probe.json" \
    --configs '[{}, {"prefill_fold": "fp32"}, {"prefill_fold": "bf16"}, {"prefill_chunk": 32}]'
best=$(python3 -c "
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if r['gate_ok']
        and max(a['o'] for a in r['accuracy'].values()) <= 4.5e-3]
med = lambda r: sorted(r['fwd_ms']['B=1 T=8192 H=96'])[1]
print(json.dumps(min(rows, key=med)['tuning']) if rows else '{}')" "$OUT/s21_fold_probe.json" 2>/dev/null || echo '{}')
echo "=== table under $best"
step 240 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" --tuning "$best" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py \
    tests/ops/test_kda_triton.py -k "prefill or chunk_states or gpu or full or causal or split or nan"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^\[accuracy\]\|^\[gate\]" | tail -c 10000
