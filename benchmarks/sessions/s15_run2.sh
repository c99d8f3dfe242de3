#!/usr/bin/env bash
# Session 15, run 2 (one H200, < 6 min): the 32-token inference forward with its prepare as two launches of the
# 16-token prepare (HALF 1, then HALF 2 joining each chunk's halves), against run 1's `_prefill_prepare32` and
# the 16-token forward, one process each behind the fp64 gate at the K3 shape and at H = 64; then the prefill kernels under Nsight
# Compute (16- and 32-token chunks) and the prefill tests.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s15_run2.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
for cfg in '{}' '{"prefill_chunk": 32}' '{"prefill_chunk": 32, "prefill_join_maxnreg": 128}' \
           '{"prefill_chunk": 32, "prefill_join_warps": 8}' '{"prefill_chunk": 32, "prefill_prepare_maxnreg": 96}' \
           '{"prefill_chunk": 32, "prefill_state_bf16": true}' '{"prefill_chunk": 32, "prefill_pair": false}'; do
    step 70 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/one.json" \
        --compare "[$cfg]" --compare-shapes "1,8192,96;1,8192,64" && python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['compare']: print(json.dumps(r))" "$OUT/one.json" >> "$OUT/compare.jsonl"
done
rm -f "$OUT/one.json"
for cfg in '{}' '{"prefill_chunk": 32}'; do
    step 150 ncu --clock-control none --profile-from-start off --set full -k regex:'^_prefill' \
        --kernel-name-base function --page details python3 -m benchmarks.kda_ncu --shape 1,8192,96 --tuning "$cfg" \
        > "$OUT/ncu-$(echo "$cfg" | tr -dc 0-9 | head -c 4)x.txt" 2>&1
done
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "prefill or chunk_states"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep "^\[compare\]\|passed\|failed\|Error" "$OUT/log.txt" | tail -40
