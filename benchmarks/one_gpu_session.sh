#!/usr/bin/env bash
# One H200, under ten minutes: the fast paths' GPU tests, the MFU table of issue 9 and where the step's time
# goes. Each step has its own time limit so that a slow one cannot take the others' time; everything printed
# also goes to $OUT/log.txt (the device returns only the tail of stdout), JSON results to $OUT (saved after every
# case). Pass the commit in (the GPU machine's copy of .git can be stale):
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/one_gpu_session.sh
# Past sessions' runs, in this form: benchmarks/sessions/*.sh, logs in benchmarks/results/logs/.
# Session 17 found the small preset host-bound at 32K tokens per micro-batch (kernels busy 90%) and device-bound
# at 64K (97%; 108 GiB peak), so the table runs at 64K tokens per micro-batch, 4 micro-batches per optimizer step,
# at T = 4096 and 8192 (session 18: 29.4% and 29.6%; session 19: 29.8% and 30.3%; session 20: 30.3% and 30.3%;
# docs/fast-paths.md).
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 65536"
{
# a cold machine: ~35-50 s of compilation in the first step, and flex's kernels at FLEX_KERNEL_OPTIONS (session 19
# run 3: 125 s for this case; the 64K x 1 row lost its 110-140 s limit in session 17 run 4 and session 18 run 1)
step 170 $TP --seq-lens 4096 --steps 2 --micro-batches 4 --json "$OUT/throughput64k_mb4.json"
step 100 $TP --seq-lens 8192 --steps 2 --micro-batches 4 --json "$OUT/throughput64k_8k_mb4.json"
# the fused RMSNorm's kernels alone (session 19: the backward's measured rule, 95 us at 768 wide)
step 40 python3 -m benchmarks.norm
# the GPU tests: test_fast_paths.py alone took over 150 s on a cold machine in session 19
step 200 python3 -m pytest -q --tb=line -p no:cacheprovider tests/gpu/test_fast_paths.py tests/optim/test_fused_step.py \
    tests/ops/test_short_conv.py tests/ops/test_mla_keys.py
# where a 64K-token step goes: device time by k3 function, kernel-busy share of the step (the host's part)
step 90 python3 benchmarks/profile_step.py --preset small --rows 16 --seq-len 4096 --steps 2 --set kda_impl=triton \
    loss_impl=triton --by-line --top 30
} 2>&1 | grep -v "Warning\|warn_once" | tee "$OUT/log.txt"
