#!/usr/bin/env bash
# Session 13, run 2 (one H200, < 9 min): the score backward per 16-row block as the only form, reading the
# prepare's G (kept by the forward, no gate in `_bwd_vk`), at the K3 shape and the small preset's; its bf16
# products and flush-to-zero exps, `_bwd_vk`'s register cap; each config through the fp64 gate. Then the KDA
# tests on the GPU (full shapes with fla's 1.5× check; the backward's slice, kept and varlen cases).
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s13_run2.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 240 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/kda-compare.json" \
    --compare '[{}, {"bwd_k_fast_exp": true}, {"bwd_k_bf16": true}, {"bwd_vk_maxnreg": 168}, {"bwd_vk_maxnreg": null}]' \
    --compare-shapes "1,8192,96;8,4096,8"
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py
step 200 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "key_slices or saved or kept_norms or varlen or causality"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
