#!/usr/bin/env bash
# Session 23, run 3 (one H200): the final code of the G_C prefetch (`_prefill_state` and `_state_bwd` load it one
# step ahead; `_state` as before, run 2 measured it slower there): the KDA GPU tests at full shapes, issue 5's
# table with fla, the inference forward's segment length and chunk size interleaved now that its state pass is
# faster, and Nsight Compute's stall samples of the new `_prefill_state` (one segment), of the training state passes
# and of the two largest backward kernels.
#     OUT=/tmp/out bash benchmarks/sessions/s23_run3.sh
. benchmarks/sessions/prelude.sh
{
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py
step 200 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 150 python3 benchmarks/sessions/s22_pipeline_probe.py --rounds 2 --no-accuracy --out "$OUT/s23_run3_probe.json" \
    --configs '[{}, {"prefill_segment_tokens": 4096}, {"prefill_segment_tokens": 1024},
                {"prefill_chunk32_max_programs": 192}]'
step 150 ncu --clock-control none --profile-from-start off --set full --import-source no \
    --section SourceCounters --section WarpStateStats -k 'regex:^_(prefill_state|state|state_bwd|bwd_k_block|bwd_vk)$' \
    --kernel-name-base function \
    -f -o "$OUT/state" python3 -m benchmarks.kda_ncu --shape 1,8192,96 --tuning '{"prefill_segments": 1}'
ncu -i "$OUT/state.ncu-rep" --page details --csv > "$OUT/state_details.csv" 2>&1
{ ncu -i "$OUT/state.ncu-rep" --page source --csv --print-source sass 2>&1; } | gzip > "$OUT/state_source.csv.gz"
rm -f "$OUT/state.ncu-rep"
grep -E "\"Duration\"|Issue Slots Busy|Registers Per|Achieved Occupancy|Warp Cycles Per Issued" "$OUT/state_details.csv" | cut -d, -f5,13-15
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^│\|^┃\|^┏\|^┡\|^└" | tail -c 11500
