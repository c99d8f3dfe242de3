#!/usr/bin/env bash
# Session 13, run 3 (one H200, < 8 min): `_bwd_k_block` at register caps 96 and 80 (5 and 6 programs per SM),
# `_bwd_vk` over 64-column slices, the value side's storage in bf16 (chunk-start states and their gradients,
# dŨ); each config through the fp64 gate, at the K3 shape and the small preset's. Then the errors against fp64 at
# T=8192 H=4 (dense, varlen mix) for the storage configs beside fla's, for the 1.5× rule.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s13_run3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 260 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/kda-compare.json" \
    --compare '[{}, {"bwd_k_maxnreg": 96}, {"bwd_k_maxnreg": 80}, {"bwd_vk_cols": 64, "bwd_vk_maxnreg": null}, {"bwd_states_bf16": true}, {"du_bf16": true}, {"bwd_states_bf16": true, "du_bf16": true}]' \
    --compare-shapes "1,8192,96;8,4096,8"
step 150 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --accuracy --out "$OUT/kda-accuracy.json" \
    --compare '[{}, {"bwd_states_bf16": true}, {"du_bf16": true}, {"bwd_states_bf16": true, "du_bf16": true}]' \
    --compare-shapes "1,2048,8"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
