#!/usr/bin/env bash
# One H200, under ten minutes: the fast paths' GPU tests, the MFU table of issue 9 and where the step's time
# goes. Each step has its own time limit so that a slow one cannot take the others' time; everything printed
# also goes to $OUT/log.txt (the device returns only the tail of stdout), JSON results to $OUT (saved after every
# case). Pass the commit in (the GPU machine's copy of .git can be stale):
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/one_gpu_session.sh
# Past sessions' runs, in this form: benchmarks/sessions/*.sh, logs in benchmarks/results/logs/.
# Session 8 found the small preset host-bound below ~32K tokens per micro-batch (docs/fast-paths.md), so the
# table runs at 32K tokens per micro-batch, with 1 and 4 micro-batches per optimizer step.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768"
{
step 120 python3 -m pytest -q --tb=line -p no:cacheprovider tests/gpu/test_fast_paths.py tests/optim/test_fused_step.py
# a cold machine: ~60 s of compilation in the first case
step 170 $TP --seq-lens 4096 8192 --steps 5 --json "$OUT/throughput32k.json"
step 150 $TP --seq-lens 4096 8192 --steps 2 --micro-batches 4 --json "$OUT/throughput32k_mb4.json"
# the short conv's backward at other tiles, by GPU kernel time (docs/fast-paths.md, session 11: occupancy-bound)
step 90 python3 -m benchmarks.short_conv --bwd-tiles 32x64x4 64x32x4 64x64x8 32x128x4
# where a 32K-token step goes: device time by k3 function, kernel-busy share of the step (the host's part)
step 140 python3 benchmarks/profile_step.py --preset small --rows 8 --seq-len 4096 --steps 3 --set kda_impl=triton \
    loss_impl=triton --by-line --top 20
} 2>&1 | grep -v "Warning\|warn_once" | tee "$OUT/log.txt"
