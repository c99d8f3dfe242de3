#!/usr/bin/env bash
# Session 25, run 5 (one H200): the pipeline's tail as the default where the state pass has more programs than SMs
# (`prefill_segments_for` returns the regular segments and the tail): the pipeline's GPU tests, then issue 5's table.
#     OUT=/tmp/out bash benchmarks/sessions/s25_run5.sh
. benchmarks/sessions/prelude.sh
{
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py \
    tests/ops/test_kda_triton.py -k "prefill or segment or pipelin or dispatch"
step 200 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
