#!/usr/bin/env bash
# Session 22, run 4 (one H200): the prepare's launch settings under the pipeline (its programs share SMs with the
# state pass), and shorter segments, timed interleaved at the inference shapes; then every KDA GPU test,
# the pipelined forward in a CUDA graph and on another stream included.
#     OUT=/tmp/out bash benchmarks/sessions/s22_run4.sh
. benchmarks/sessions/prelude.sh
{
step 150 python3 benchmarks/sessions/s22_pipeline_probe.py --rounds 2 --out "$OUT/s22_run4_probe.json" --configs \
    '[{}, {"prefill_prepare_maxnreg": 96}, {"prefill_prepare_maxnreg": 168}, {"prefill_prepare_warps": 8},
      {"prefill_segment_tokens": 1024}]'
step 330 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
    tests/gpu/test_kda_triton_gpu.py
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 11500
