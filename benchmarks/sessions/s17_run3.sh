#!/usr/bin/env bash
# Session 17, run 3 (one H200, < 8 min): the fused AttnRes read's launch settings at 64K tokens (run 2: its backward
# 47 ms per 64K-token step, ~50% of the bandwidth its bytes need; 4 warps, 2 rows per tile, 4 programs per SM),
# then every fast-path GPU test on this code (run 2 ran a subset).
#     OUT=/tmp/out bash benchmarks/sessions/s17_run3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 200 python3 -m benchmarks.attn_res --tiles
step 260 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 7000 "$OUT/log.txt"
