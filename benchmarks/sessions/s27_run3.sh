#!/usr/bin/env bash
# Session 27, run 3 (one H200): run 2's reorder reverted; the defaults now are session 26's kernel order with
# dAkk = −Tᵀ·(dŨ·Ũᵀ) (§7 item 57), dA in bf16 (item 58) and `_bwd_vv` on value blocks of 64 at 2 stages. The KDA GPU
# tests that run the backward, issue 5's forward + backward rows against fla*, then launch variants.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s27_run3.sh
. benchmarks/sessions/prelude.sh
{
step 330 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py tests/ops/test_kda_triton.py \
    -k "gpu or key_slices or full_head or saved or bf16_storage or fp64 or long_sequence or kept_norms or varlen_tiny"
step 120 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" --cases "fwd+bwd" \
    --fla-cases "fwd+bwd B=1 T=8192 H=96"
step 120 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/s27_run3_compare.json" \
    --compare '[{}, {"bwd_k_maxnreg": 64}, {"bwd_vk_stages": 4}, {"bwd_vv_warps": 4}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
