#!/usr/bin/env bash
# Session 19, run 1 (one H200): the GPU tests at HEAD (the streaming conv's shared prologue, the chunked AttnRes
# backward at full shape, the new MLA keys pair and the strided norm rows have not run on a GPU); the MLA keys
# pair against torch's cats; the norm's settings; the AttnRes tiles (the untimed chunked backward); the 64K x 4
# MFU row; the step's profile.
#     OUT=/tmp/out bash benchmarks/sessions/s19_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 65536"
{
step 190 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py tests/ops/test_short_conv.py \
    tests/ops/test_mla_keys.py
step 45 python3 -m benchmarks.mla_keys
step 35 python3 -m benchmarks.norm
step 170 $TP --seq-lens 4096 --steps 2 --micro-batches 4 --json "$OUT/throughput64k_mb4.json"
step 45 python3 -m benchmarks.attn_res --tiles
step 100 python3 benchmarks/profile_step.py --preset small --rows 16 --seq-len 4096 --steps 2 --set kda_impl=triton \
    loss_impl=triton --by-line --top 30
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^ \|^---\|^│\|^┃\|^┏\|^┡\|^└" "$OUT/log.txt" | grep -v "^\s*$" | tail -c 9000
