#!/usr/bin/env bash
# Session 14, run 3 (one H200, < 10 min): the 16-token inference forward with W = P·K_d and U = P·V formed by the
# prepare (`prefill_wu`) against the regrouped form (P in the state pass), launch settings one process each at the
# K3 shape; the few-heads shapes; then issue 5's table with fla under the fastest forward setting.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s14_run3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
for cfg in '{}' '{"prefill_prepare_maxnreg": null}' '{"prefill_wu": false}' '{"prefill_state_stages": 3}' \
           '{"prefill_state_bv": 128, "prefill_state_warps": 8}'; do
    step 60 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/one.json" \
        --compare "[$cfg]" --compare-shapes "1,8192,96" && python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['compare'][0]))" \
        "$OUT/one.json" >> "$OUT/compare.jsonl"
done
rm -f "$OUT/one.json"
best=$(python3 -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if r.get('gate_ok') and r.get('fwd_ms')]
print(json.dumps(min(rows, key=lambda r: r['fwd_ms'])['tuning']) if rows else '{}')" "$OUT/compare.jsonl")
echo "fastest forward config: $best"
step 220 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" --tuning "$best" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 7000 "$OUT/log.txt"
