#!/usr/bin/env bash
# Session 23, run 4 (one H200): with G_C loaded ahead, the inference state pass at 55% of DRAM bandwidth re-reads
# W, Q_d and K_r once per value block (run 3's counters: L2 hit rate 20%). One program per (sequence, head) at
# BV = 128 on 8 warps (207 registers, no spills offline: two warpgroups share the loaded tiles) against BV = 64 on
# 4 warps, interleaved (the probe checks each setting's outputs against the first's, bit for bit). The device
# time left after refused starts (about 4 minutes) held no room for the GPU tests under these settings.
#     OUT=/tmp/out bash benchmarks/sessions/s23_run4.sh
. benchmarks/sessions/prelude.sh
BV128='{"prefill_state_bv": 128, "prefill_state_warps": 8, "prefill_min_programs": 64, "prefill_chunk32_max_programs": 32}'
{
step 120 python3 benchmarks/sessions/s22_pipeline_probe.py --rounds 2 --no-accuracy --out "$OUT/s23_run4_probe.json" \
    --configs "[{}, $BV128, ${BV128%\}}, \"prefill_segments\": 1}, ${BV128%\}}, \"prefill_segment_tokens\": 1024}]"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 11500
