#!/usr/bin/env bash
# Session 15, run 3 (one H200, < 5 min): the prepares' 16×16 inverses as tf32x3 tensor-core products
# (`prefill_inverse_mma`, `prep_inverse_mma`; Nsight Compute in run 2: `_prefill_prepare` is bound by L1/shared
# memory, 85% busy, with 3-5-way bank conflicts from the FMA dots' operands), alone and with the 32-token chunks
# (join at 128 registers, run 2's best), one process each behind the fp64 gate at the K3 shape and at H = 64.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s15_run3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
for cfg in '{}' '{"prefill_inverse_mma": true}' '{"prefill_inverse_mma": true, "prefill_prepare_maxnreg": 128}' \
           '{"prefill_chunk": 32, "prefill_join_maxnreg": 128}' \
           '{"prefill_chunk": 32, "prefill_join_maxnreg": 128, "prefill_inverse_mma": true}' \
           '{"prefill_chunk": 32, "prefill_join_maxnreg": 128, "prefill_inverse_mma": true, "prefill_prepare_maxnreg": 128}' \
           '{"prep_inverse_mma": true}'; do
    step 70 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/one.json" \
        --compare "[$cfg]" --compare-shapes "1,8192,96;1,8192,64" && python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['compare']: print(json.dumps(r))" "$OUT/one.json" >> "$OUT/compare.jsonl"
done
rm -f "$OUT/one.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep "^\[compare\]\|correctness\|passed\|failed\|Error" "$OUT/log.txt" | tail -40
