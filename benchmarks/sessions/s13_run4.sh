#!/usr/bin/env bash
# Session 13, run 4 (one H200, < 9 min): the new defaults (`_bwd_k_block` capped at 80 registers, `_bwd_vk` over
# 64-column slices uncapped) against `_bwd_k_block` at 72 and 64 registers, `_bwd_vk` at 2 stages and
# `_prep_intra` at 96 registers, at the K3 shape and the small preset's (fp64 gate first). Then the KDA tests on
# the GPU.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s13_run4.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 200 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/kda-compare.json" \
    --compare '[{}, {"bwd_k_maxnreg": 72}, {"bwd_k_maxnreg": 64}, {"bwd_vk_stages": 2}, {"prep_intra_maxnreg": 96}]' \
    --compare-shapes "1,8192,96;8,4096,8"
step 110 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py
step 200 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "key_slices or saved or kept_norms or varlen or causality or prepare"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
