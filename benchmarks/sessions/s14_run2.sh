#!/usr/bin/env bash
# Session 14, run 2 (one H200, < 10 min): the fused 16-token inference forward (`_prefill_fused`: the prepare inside
# the state pass) against the two-kernel one and the 64-token one, each launch setting in its own process, at the K3
# shape and the few-heads shapes; then the prefill tests on the GPU.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s14_run2.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
for cfg in '{}' '{"prefill_fused": false}' '{"prefill_state_bv": 128, "prefill_state_warps": 8}' \
           '{"prefill_state_stages": 1}' '{"prefill_state_stages": 3}' \
           '{"prefill_fused": false, "prefill_prepare_maxnreg": 96}'; do
    step 50 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/one.json" \
        --compare "[$cfg]" --compare-shapes "1,8192,96" && python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['compare'][0]))" \
        "$OUT/one.json" >> "$OUT/compare.jsonl"
done
rm -f "$OUT/one.json"
step 80 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/few.json" \
    --compare '[{}, {"prefill_state_bv": 32}, {"prefill_fused": false}]' --compare-shapes "1,32768,32;1,8192,64"
step 170 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py tests/ops/test_kda_triton.py \
    -k "full_shape or long or prefill or prefix or causality or split_call or nan_initial or decode_after or inference"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 6000 "$OUT/log.txt"
