#!/usr/bin/env bash
# Session 28, run 1 (one H200), prepared in session 27 for its first device time: issue 5's table on session 27's
# final code (`bwd_k_maxnreg` 64 became the default after its last table), then the KDA GPU tests session 27 did not
# run under its final defaults (prefill, pipeline, segment, head dims, causality, split calls, decode).
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s28_run1.sh
. benchmarks/sessions/prelude.sh
{
step 150 python3 -m benchmarks.kda --fla-configs 1 --accuracy --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 330 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py tests/ops/test_kda_triton.py \
    -k "not (key_slices or fp64 or kept_norms or saved or varlen_tiny)"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
