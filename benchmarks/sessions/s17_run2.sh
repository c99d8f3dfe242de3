#!/usr/bin/env bash
# Session 17, run 2 (one H200, < 9 min): the new fast paths on the GPU (sealed AttnRes sources, split-bf16 router
# logits, fused top-k + cutoff, fused QB histogram) -- their GPU tests and the tiny model against the references --
# then the MFU row at 64K tokens (run 1: 0.722 s, 23.2%), 64K x 2 micro-batches (run 1: 1.337 s, 25.3%) and the
# profile of a 64K-token step (run 1: 664 ms of kernels).
#     OUT=/tmp/out bash benchmarks/sessions/s17_run2.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast"
{
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py -k \
    "split_router or topk or qb_histogram or attn_res_triton or tiny_model"
step 120 $TP --tokens 65536 --seq-lens 4096 --steps 3 --json "$OUT/throughput64k.json"
step 90 $TP --tokens 65536 --seq-lens 4096 --steps 2 --micro-batches 2 --json "$OUT/throughput64k_mb2.json"
step 130 python3 benchmarks/profile_step.py --preset small --rows 16 --seq-len 4096 --steps 2 --set kda_impl=triton \
    loss_impl=triton --by-line --top 40
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^ \|^---" "$OUT/log.txt" | tail -c 5000
grep -A42 "device time by k3 function (" "$OUT/log.txt" | head -44
