#!/usr/bin/env bash
# Session 18, run 3 (one H200, < 8 min): the streaming short conv again (its dx fixed: positions loaded, not
# carried), more flex options around run 2's winner (warps, stages, the forward's blocks), the AttnRes read at one and two warps, the loss's chunk sizes
# and row-kernel forms (benchmarks.cross_entropy --rows-settings), then the 64K x 4 MFU row on this code (flex
# 32/128/128/32, the loss's new chunk rule; the conv still on its tile kernels).
#     OUT=/tmp/out bash benchmarks/sessions/s18_run3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 90 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_short_conv.py -k "stream"
step 120 python3 -m benchmarks.short_conv --stream 128x1024x4x1 128x1024x4x3 64x512x2x3 128x512x2x3 256x512x2x3 \
    512x512x2x4 128x256x1x3 256x256x1x4
step 200 python3 benchmarks/flex_options.py --shape 16,4096,8,192,128 --doc-mean 2000 --iters 5 --options '[
 {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "bwd_num_stages": 2, "bwd_num_warps": 8},
 {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "bwd_num_stages": 2, "bwd_num_warps": 4},
 {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "bwd_num_stages": 3, "bwd_num_warps": 8},
 {"BLOCK_M1": 16, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 16, "bwd_num_stages": 2, "bwd_num_warps": 8},
 {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "bwd_num_stages": 3, "bwd_num_warps": 8},
 {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "bwd_num_stages": 2, "bwd_num_warps": 8,
  "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 2},
 {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "bwd_num_stages": 2, "bwd_num_warps": 8,
  "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 32, "fwd_num_warps": 4, "fwd_num_stages": 3}]'
step 100 python3 -m benchmarks.attn_res --tiles
step 120 python3 -m benchmarks.cross_entropy --rows-settings
step 100 python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 65536 \
    --seq-lens 4096 --steps 2 --micro-batches 4 --json "$OUT/throughput64k_mb4.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^ \|^---\|^│\|^┃\|^┏\|^┡\|^└" "$OUT/log.txt" | grep -v "^\s*$" | tail -c 9000
