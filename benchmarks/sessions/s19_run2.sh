#!/usr/bin/env bash
# Session 19, run 2 (one H200): the MLA keys and short conv tests (run 1's test step ran out of time); the norm's
# settings timed as kernels alone; the fused projections' split backward against autograd's cat; the AttnRes
# chunked backward; the 64K x 4 MFU row with the split backward; then the fast-path GPU tests.
#     OUT=/tmp/out bash benchmarks/sessions/s19_run2.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 65536"
{
step 70 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_mla_keys.py tests/ops/test_short_conv.py
step 60 python3 -m benchmarks.norm
step 40 python3 -m benchmarks.fused_linears
step 90 python3 -m benchmarks.attn_res --tiles
step 150 $TP --seq-lens 4096 --steps 2 --micro-batches 4 --json "$OUT/throughput64k_mb4.json"
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^ \|^---\|^│\|^┃\|^┏\|^┡\|^└" "$OUT/log.txt" | grep -v "^\s*$" | tail -c 9000
