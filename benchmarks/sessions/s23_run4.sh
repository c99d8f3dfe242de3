#!/usr/bin/env bash
# Session 23, run 4 (one H200): with G_C loaded ahead, the inference state pass at 55% of DRAM bandwidth re-reads
# W, Q_d and K_r once per value block (run 3's counters: L2 hit rate 20%). One program per (sequence, head) at
# BV = 128 on 8 warps (207 registers, no spills offline: two warpgroups share the loaded tiles) against BV = 64 on
# 4 warps, interleaved, with the fp64 errors; then the KDA GPU tests under the BV = 128 settings.
#     OUT=/tmp/out bash benchmarks/sessions/s23_run4.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
BV128='{"prefill_state_bv": 128, "prefill_state_warps": 8, "prefill_min_programs": 64, "prefill_chunk32_max_programs": 32}'
{
step 90 python3 benchmarks/sessions/s22_pipeline_probe.py --rounds 2 --no-accuracy --out "$OUT/s23_run4_probe.json" \
    --configs "[{}, $BV128, ${BV128%\}}, \"prefill_segments\": 1}, ${BV128%\}}, \"prefill_segment_tokens\": 1024}]"
step 100 python3 -c "import sys, json; from k3.ops.kda import triton_common as tc; tc.TUNING.update(json.loads(sys.argv[1])); import pytest; sys.exit(pytest.main(sys.argv[2:]))" \
    "$BV128" -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 11500
