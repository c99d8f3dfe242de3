#!/usr/bin/env bash
# Session 13, run 6 (one H200, < 5 min): launch settings of the smaller KDA kernels on the final code, from the
# offline sm_90 report (`benchmarks/kda_spills.py`): `_prep_wu` at 8 warps (76 registers), `_prep_intra` at 8,
# `_bwd_gate` at 8 warps or 16 columns, `_bwd_vv` at 4 warps and 168 registers; fp64 gate first, K3 and small shapes.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s13_run6.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 200 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/kda-compare.json" \
    --compare '[{}, {"prep_wu_warps": 8, "prep_wu_maxnreg": null}, {"prep_intra_warps": 8}, {"bwd_gate_warps": 8}, {"bwd_gate_cols": 16}, {"bwd_vv_warps": 4, "bwd_vv_maxnreg": 168}]' \
    --compare-shapes "1,8192,96;8,4096,8"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 6000 "$OUT/log.txt"
