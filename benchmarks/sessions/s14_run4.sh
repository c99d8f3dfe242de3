#!/usr/bin/env bash
# Session 14, run 4 (one H200, < 9 min): launch settings of the 16-token inference forward around the run-3 winners
# (W/U from the prepare, 3-stage state pass, uncapped prepare), one process each at the K3 shape; issue 5's table
# with fla under the fastest; then every KDA test on the GPU.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s14_run4.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
for cfg in '{}' '{"prefill_state_stages": 4}' '{"prefill_prepare_warps": 8}' \
           '{"prefill_state_warps": 8}' '{"prefill_state_bf16": true}'; do
    step 60 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/one.json" \
        --compare "[$cfg]" --compare-shapes "1,8192,96" && python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['compare'][0]))" \
        "$OUT/one.json" >> "$OUT/compare.jsonl"
done
rm -f "$OUT/one.json"
best=$(python3 -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if r.get('gate_ok') and r.get('fwd_ms') and 'prefill_state_bf16' not in r['tuning']]
print(json.dumps(min(rows, key=lambda r: r['fwd_ms'])['tuning']) if rows else '{}')" "$OUT/compare.jsonl")
echo "fastest forward config: $best"
step 150 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" --tuning "$best" --cases "fwd B" \
    --fla-cases "fwd B=1 T=8192 H=96"
step 240 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py tests/ops/test_kda_triton.py
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 7000 "$OUT/log.txt"
