#!/usr/bin/env bash
# Session 16, run 2 (one H200, < 10 min): the residual stream in the activation dtype (bf16 under autocast) and the
# SiTU MLPs' gate and up as one GEMM: the fast paths' GPU tests, the MFU row at 32K tokens (T = 4096) with the
# new default and with residual_dtype=float32 side by side, the step's profile (compare s16-run1), loss curves.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s16_run2.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768"
{
step 110 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py tests/optim/test_fused_step.py
step 140 $TP --seq-lens 4096 --steps 5 --json "$OUT/throughput32k.json"
step 95 $TP --seq-lens 4096 --steps 5 --set residual_dtype=float32 --json "$OUT/throughput32k_fp32res.json"
step 150 python3 benchmarks/profile_step.py --preset small --rows 8 --seq-len 4096 --steps 3 --set kda_impl=triton \
    loss_impl=triton --by-line --top 30
step 80 python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants reference fast \
    --tokens 4096 --seq-lens 4096 --steps 1 --loss-steps 50 --json "$OUT/loss_curves.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 11000 "$OUT/log.txt"
