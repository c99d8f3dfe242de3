#!/usr/bin/env bash
# One H200, under ten minutes: the fast paths' GPU tests, where the training step's time goes, and the MFU table
# of issue 9. Each step has its own time limit so that a slow one cannot take the others' time; everything
# printed also goes to $OUT/log.txt (the device returns only the tail of stdout), JSON results to $OUT. Pass the
# commit in (the GPU machine's copy of .git can be stale):
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/one_gpu_session.sh
# Past sessions' runs, in this form: benchmarks/sessions/run*.sh, logs in benchmarks/results/logs/.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 150 python3 -m pytest -q --tb=line -p no:cacheprovider tests/gpu/test_fast_paths.py tests/gpu/test_kda_triton_gpu.py \
    tests/optim/test_fused_step.py
# where the step goes (session 6: 171 ms of device time per 8K tokens; KDA, Newton-Schulz, the loss on top)
step 90 python3 benchmarks/profile_step.py --preset small --rows 2 --seq-len 4096 --set kda_impl=triton \
    loss_impl=triton --by-line
# issue 9: MFU at 4K and 8K (the reference ops only fit with checkpointing), then the per-path ablations
step 300 python3 benchmarks/train_throughput.py --presets small --seq-lens 4096 8192 --tokens 16384 --steps 2 \
    --kda-impl triton --variants reference-ckpt fast fast-ckpt --ablate-at 4096 --time-budget 270 \
    --json "$OUT/throughput.json"
} 2>&1 | tee "$OUT/log.txt"
