#!/usr/bin/env bash
# Session 23, run 1 (one H200): session 22's review fixes on the GPU (the pipeline, segment and prefix-caching
# tests, the GPU file with the graph test against one segment and fp64), issue 5's table at that code, and Nsight
# Compute's stall samples of the inference state pass alone (one segment) at the K3 shape.
#     OUT=/tmp/out bash benchmarks/sessions/s23_run1.sh
. benchmarks/sessions/prelude.sh
{
step 200 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py \
    "tests/ops/test_kda_triton.py" -k "pipeline or prefix_caching or segment or gpu or graph or full"
step 230 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 120 ncu --clock-control none --profile-from-start off --set full --import-source no \
    --section SourceCounters --section WarpStateStats -k 'regex:^_prefill_state' --kernel-name-base function \
    -f -o "$OUT/state" python3 -m benchmarks.kda_ncu --shape 1,8192,96 --tuning '{"prefill_segments": 1}'
ncu -i "$OUT/state.ncu-rep" --page details --csv > "$OUT/state_details.csv" 2>&1
{ ncu -i "$OUT/state.ncu-rep" --page source --csv --print-source sass 2>&1; } | gzip > "$OUT/state_source.csv.gz"
rm -f "$OUT/state.ncu-rep"
grep -E "Duration|Issue Slots Busy|Registers Per|Achieved Occupancy|Stall|Warp Cycles Per Issued" "$OUT/state_details.csv" | head -40
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 11500
