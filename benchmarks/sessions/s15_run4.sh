#!/usr/bin/env bash
# Session 15, run 4 (one H200, < 4 min): M stored as its bf16 split by the prepare (`_store_m`: the state pass
# reads hi and lo as loaded, no split and shared-memory round trip per step), at the new defaults (32-token
# chunks, join at 128 registers) and their neighbours, one process each behind the fp64 gate at the K3 shape and
# H = 64; the few-programs case (T = 32768, H = 32) with the inference kernels forced, for `prefill_applies`.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s15_run4.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
one() {  # one config at the given shapes, its rows appended to compare.jsonl
    step 90 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/one.json" \
        --compare "[$1]" --compare-shapes "$2" && python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['compare']: print(json.dumps(r))" "$OUT/one.json" >> "$OUT/compare.jsonl"
}
{
for cfg in '{}' '{"prefill_prepare_maxnreg": 128}' '{"prefill_state_stages": 4}' '{"prefill_chunk": 16}' \
           '{"prefill_chunk": 16, "prefill_prepare_maxnreg": 128}'; do
    one "$cfg" "1,8192,96;1,8192,64"
done
one '{"prefill_min_programs": 0}' "1,32768,32"
one '{"prefill": false}' "1,32768,32"
rm -f "$OUT/one.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep "^\[compare\]\|correctness\|passed\|failed\|Error" "$OUT/log.txt" | tail -40
