#!/usr/bin/env bash
# Session 15, run 1 (one H200, < 8 min): the untimed 32-token inference forward of session 14 and its launch
# settings, one process each behind the fp64 gate at the K3 shape, then the prefill tests on the GPU.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s15_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
for cfg in '{}' '{"prefill_chunk": 32}' '{"prefill_chunk": 32, "prefill_prepare_warps": 8}' \
           '{"prefill_chunk": 32, "prefill_state_stages": 2}' '{"prefill_chunk": 32, "prefill_state_bf16": true}' \
           '{"bwd_k_warps": 8}' '{"bwd_vk_bv": 64, "bwd_vk_stages": 2}'; do
    step 70 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/one.json" \
        --compare "[$cfg]" --compare-shapes "1,8192,96" && python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['compare'][0]))" \
        "$OUT/one.json" >> "$OUT/compare.jsonl"
done
rm -f "$OUT/one.json"
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "prefill"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
