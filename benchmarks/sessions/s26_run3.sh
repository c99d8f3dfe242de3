#!/usr/bin/env bash
# Session 26, run 3 (one H200): the rest of the KDA GPU tests that run 2 cut at its 300 s limit (from the 75th
# collected, with a margin: run 2 passed the first 77, one skipped), then issue 5's table on the final code (fla*:
# one config per autotuner) with fla's errors beside ours.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s26_run3.sh
. benchmarks/sessions/prelude.sh
{
ids=$(python3 -m pytest --collect-only -q -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py tests/ops/test_kda_triton.py \
      2>/dev/null | grep "::" | tail -n +75)
echo "=== $(echo "$ids" | wc -l) tests from the 75th"
step 200 python3 -m pytest -q --tb=short -p no:cacheprovider $ids
step 330 python3 -m benchmarks.kda --fla-configs 1 --accuracy --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
