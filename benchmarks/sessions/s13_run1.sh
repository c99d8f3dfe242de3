#!/usr/bin/env bash
# Session 13, run 1 (one H200, < 9 min): the score backward per 16-row block (`_bwd_k_block` + `_bwd_gate`,
# TUNING["bwd_k_form"] = "block") against the two-sweep `_bwd_k`, at the K3 shape and the small preset's, with
# its slice width and warps; each config through the fp64 gate. Then the new form's tests on the GPU.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s13_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 300 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/kda-compare.json" \
    --compare '[{}, {"bwd_k_form": "block"}, {"bwd_k_form": "block", "bwd_k_cols": 16, "bwd_k_maxnreg": null}, {"bwd_k_form": "block", "bwd_k_cols": 64, "bwd_k_maxnreg": null}, {"bwd_k_form": "block", "bwd_k_warps": 2, "bwd_k_maxnreg": null}, {"bwd_k_form": "block", "bwd_gate_cols": 128}]' \
    --compare-shapes "1,8192,96;8,4096,8"
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "score_form or key_slices"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
