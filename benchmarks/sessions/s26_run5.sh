#!/usr/bin/env bash
# Session 26, run 5 (one H200): run 4's winner as the default (`_bwd_vk` on value blocks of 64 at 3 stages with
# bf16 tiles; fp32 tiles keep BV 32 at 4 stages): the KDA GPU tests that run the backward, then the issue table's
# forward + backward rows (fla* only at the K3 shape, one config per autotuner).
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s26_run5.sh
. benchmarks/sessions/prelude.sh
{
step 330 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py tests/ops/test_kda_triton.py \
    -k "gpu or key_slices or full_head or saved or bf16_storage or fp64 or long_sequence or kept_norms or varlen_tiny"
step 150 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" --cases "fwd+bwd" \
    --fla-cases "fwd+bwd B=1 T=8192 H=96"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
