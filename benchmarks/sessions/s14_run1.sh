#!/usr/bin/env bash
# Session 14, run 1 (one H200, < 10 min): the 16-token inference forward (`triton_prefill.py`). The KDA tests on the
# GPU, then each launch setting of the new kernels in its own process (a faulting build cannot take the others
# with it), gated against fp64 and timed beside the 64-token inference forward ({"prefill": false}) at the K3 shape.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s14_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py tests/gpu/test_kda_triton_gpu.py
for cfg in '{"prefill": false}' '{}' '{"prefill_state_bv": 32}' '{"prefill_state_bv": 32, "prefill_state_warps": 8}' \
           '{"prefill_state_warps": 8}' '{"prefill_state_bv": 128, "prefill_state_warps": 8}' \
           '{"prefill_state_stages": 3}'; do
    step 50 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/one.json" \
        --compare "[$cfg]" --compare-shapes "1,8192,96" && python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['compare'][0]))" \
        "$OUT/one.json" >> "$OUT/compare.jsonl"
done
# the few-heads shapes of the issue, where the state pass has N·H·V/BV = 64-128 programs
step 80 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/few.json" \
    --compare '[{"prefill": false}, {}, {"prefill_state_bv": 32}]' --compare-shapes "1,32768,32;1,8192,64"
rm -f "$OUT/one.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 11000 "$OUT/log.txt"
