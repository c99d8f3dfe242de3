#!/usr/bin/env bash
# Issue 5 on one H200, under ten minutes: each launch config of a configs file in its
# own process (a config that faults cannot take the others with it), then the table with fla under the
# fastest config (inference forward + forward+backward). Logs to $OUT/log.txt, JSON to $OUT/compare.jsonl and
# $OUT/kda.json (at most 8 files come back from a device call). Pass the commit in (the GPU machine's .git copy can be stale):
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/kda_session.sh [configs file]
#     KDA_TESTS=1 OUT=/tmp/out bash benchmarks/kda_session.sh   # the KDA tests on the GPU, in a second call
#     SHAPES="1,8192,96;1,8192,64" …   # the shapes each config is timed at (the first picks the table's config)
# Default configs: benchmarks/kda_next_configs.txt (docs/kda-kernels.md §8: after session 22's inference defaults
# (the pipeline of segments, 32-token chunks at or below 64 state programs, bf16 state products), each of them undone
# on this code: no pipeline, 16-token chunks everywhere, split products).
set -u
OUT=${OUT:-benchmarks/results}
CONFIGS=${1:-benchmarks/kda_next_configs.txt}
SHAPES=${SHAPES:-1,8192,96}
mkdir -p "$OUT"
# fla-core as wheels in .whl (device README: carry ".whl"); without them the table is k3's alone
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
if [ -n "${KDA_TESTS:-}" ]; then  # the tests alone: a call of their own (both parts overrun one 10-minute call)
    step 300 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
        tests/gpu/test_kda_triton_gpu.py 2>&1 | tee "$OUT/log.txt"
    exit 0
fi
{
step 60 compute-sanitizer --tool memcheck --print-limit 5 python3 -m benchmarks.kda --quick --fla-cases none \
    --tuning '{"state_bv": 16}'
while IFS= read -r cfg; do
    [ -z "$cfg" ] && continue
    step 90 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/one.json" \
        --compare "[$cfg]" --compare-shapes "$SHAPES" && python3 -c "
import json, sys
for row in json.load(open(sys.argv[1]))['compare']: print(json.dumps(row))" "$OUT/one.json" >> "$OUT/compare.jsonl"
done < "$CONFIGS"
rm -f "$OUT/one.json"
best=$(python3 -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
first = rows[0]['shape'] if rows else None
rows = [r for r in rows if r.get('gate_ok') and r.get('fwd_bwd_ms') and 'prefill_state_bf16' not in r['tuning']
        and r['shape'] == first]
# the inference forward (fwd, no_grad) and the training step (fwd+bwd) run different kernels: both count
print(json.dumps(min(rows, key=lambda r: r['fwd_ms'] + r['fwd_bwd_ms'])['tuning']) if rows else '{}')" "$OUT/compare.jsonl")
echo "fastest config (inference forward + forward+backward): $best"
step 200 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" --tuning "$best" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" | tee "$OUT/log.txt"
