#!/usr/bin/env bash
# Session 7, run 10: the tests that failed on the GPU in runs 7-9, after BV = 16 at K = 16 and the GPU (tf32)
# tolerances.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
T=tests/ops/test_kda_triton.py
timeout 200 python3 -m pytest -v --tb=line -p no:cacheprovider $T -k "(matches_fp64_recurrence and 65) or (bwd_k_split and varlen_fp32)" 2>&1 | tee "$OUT/log.txt"
