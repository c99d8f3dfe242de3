#!/usr/bin/env bash
# Session 7, run 9 (the budget's last ~6 minutes): does a one-stage pipeline or BV 16 avoid the K = 16, V = 32
# fault; the values of the small-shape tests that failed on the GPU in runs 7-8, each group in its own pytest
# process so that a time limit cannot take the others' summaries.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
T=tests/ops/test_kda_triton.py
{
step 50 python3 benchmarks/sessions/k16_diag.py "K16 V32 dense T=130, bwd_v_stages 1" "K16 V32 dense T=130, bwd_v_bv 16"
step 70 python3 -m pytest -v --tb=line -p no:cacheprovider $T -k "matches_fp64_recurrence and (63 or 65)"
step 80 python3 -m pytest -v --tb=line -p no:cacheprovider $T -k "bwd_k_split and (K64 or one_slice) or both_splits"
step 70 python3 -m pytest -v --tb=line -p no:cacheprovider $T -k "layer_triton_matches or layer_training"
} 2>&1 | tee "$OUT/log.txt"
