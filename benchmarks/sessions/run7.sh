#!/usr/bin/env bash
# Session 7, run 7: the KDA kernel tests of tests/ops on the GPU (never run there at K < 128 before run 6's
# crash), the crashing case first and alone with CUDA_LAUNCH_BLOCKING=1; then launch configs and the split
# `_bwd_k` side by side in one process (`--compare`). Logs to $OUT/log.txt.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
T=tests/ops/test_kda_triton.py
{
CUDA_LAUNCH_BLOCKING=1 step 90 python3 -m pytest -v -p no:cacheprovider $T -k "varlen_tiny_documents"
CUDA_LAUNCH_BLOCKING=1 step 90 python3 -m pytest -v -p no:cacheprovider $T -k "prepare_split_matches_fp64_recurrence and varlen"
step 200 python3 -m pytest -q -p no:cacheprovider $T -k "not varlen_tiny_documents and not (prepare_split_matches_fp64_recurrence and varlen)"
step 330 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/compare.json" --compare '[
 {},
 {"prepare_split": true},
 {"prepare_split": true, "bwd_k_split": true},
 {"prepare_split": true, "bwd_k_split": true, "bwd_ks_maxnreg": 168},
 {"prepare_split": true, "bwd_k_split": true, "bwd_ks_maxnreg": 128},
 {"prepare_split": true, "bwd_k_split": true, "bwd_ks_cols": 64, "bwd_ks_warps": 8, "bwd_ks_maxnreg": 128},
 {"prepare_split": true, "bwd_k_maxnreg": 96},
 {"prepare_split": true, "prep_intra_maxnreg": 128},
 {"prepare_split": true, "prep_wu_maxnreg": 128, "bwd_v_maxnreg": 168},
 {"prepare_split": true, "bwd_v_maxnreg": 128}
]'
} 2>&1 | tee "$OUT/log.txt"
