#!/usr/bin/env bash
# Session 18, run 1 (one H200, < 8 min): the stacked AttnRes backward's first GPU test and timing (the launch
# settings sweep), then the 64K-token MFU rows on session 17's final code (the 64K x 1 row lost in s17 run 4).
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s18_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 65536"
{
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py -k "attn_res"
step 120 python3 -m benchmarks.attn_res --tiles
step 140 $TP --seq-lens 4096 --steps 3 --json "$OUT/throughput64k.json"
step 90 $TP --seq-lens 4096 --steps 2 --micro-batches 4 --json "$OUT/throughput64k_mb4.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^ \|^---\|^│\|^┃\|^┏\|^┡\|^└" "$OUT/log.txt" | grep -v "^\s*$" | tail -c 6000
