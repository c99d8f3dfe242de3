#!/usr/bin/env bash
# Session 22, run 3 (one H200): issue 5 at the final inference rules (the pipeline one segment per 2048 tokens, at
# most 8, within one wave and from 2^19 token-heads; the inference kernels from 128 programs, or 64 with 2^20
# token-heads): state-pass launch variants timed interleaved at the inference shapes, the table with
# fla, the KDA GPU tests.
#     OUT=/tmp/out bash benchmarks/sessions/s22_run3.sh
. benchmarks/sessions/prelude.sh
{
step 150 python3 benchmarks/sessions/s22_pipeline_probe.py --rounds 2 --out "$OUT/s22_run3_probe.json" --configs \
    '[{}, {"prefill_state_bv": 128, "prefill_state_warps": 8}, {"prefill_state_bv": 128}, {"prefill_state_stages": 2},
      {"prefill_segments": 4}]'
step 230 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 170 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
    tests/gpu/test_kda_triton_gpu.py -k "prefill or gpu or full or pipeline or segment"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 11500
