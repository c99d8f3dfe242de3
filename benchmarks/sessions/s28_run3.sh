#!/usr/bin/env bash
# Session 28, run 3 (one H200): the defaults after run 2 (`bwd_scratch_bf16` and `state_o_apart` on): issue 5's table
# with the errors against fp64 beside fla*'s, then the KDA GPU tests that run a training forward or a backward (the
# inference forward, the pipeline and decode did not change this session).
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s28_run3.sh
. benchmarks/sessions/prelude.sh
{
step 200 python3 -m benchmarks.kda --fla-configs 1 --accuracy --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 300 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py tests/ops/test_kda_triton.py \
    -k "not (prefill or pipeline or segment or decode)"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
