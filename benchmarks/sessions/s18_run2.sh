#!/usr/bin/env bash
# Session 18, run 2 (one H200, < 8 min): the streaming short-conv kernels (GPU tests, then their settings against
# the tile kernels at a 64K-token step's conv and K3's width) and flex_attention's backward options at a 64K-token
# micro-batch's MLA shape (16 x 4096, documents of mean 2000), TMA loads and wider blocks among them.
#     OUT=/tmp/out bash benchmarks/sessions/s18_run2.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_short_conv.py -k "fused"
step 150 python3 -m benchmarks.short_conv --stream 128x1024x4x1 128x1024x4x3 64x512x2x3 128x512x2x3 256x512x2x3 \
    512x512x2x4 128x256x1x3 256x256x1x4
step 240 python3 benchmarks/flex_options.py --shape 16,4096,8,192,128 --doc-mean 2000 --iters 5 --options '[
 {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "bwd_num_stages": 2, "bwd_num_warps": 8},
 {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "bwd_num_stages": 2, "bwd_num_warps": 8, "USE_TMA": true},
 {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "bwd_num_stages": 2, "bwd_num_warps": 8},
 {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "bwd_num_stages": 2, "bwd_num_warps": 8},
 {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "bwd_num_stages": 3, "bwd_num_warps": 8, "USE_TMA": true}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^ \|^---\|^│\|^┃\|^┏\|^┡\|^└" "$OUT/log.txt" | grep -v "^\s*$" | tail -c 7000
