#!/usr/bin/env bash
# Session 7, run 8: the K = 16 fault isolated; tests/ops KDA tests on the GPU with one-line tracebacks (their
# values); the GPU tests at full shapes under the new KDA defaults (split _prepare and _bwd_k); MFU of the
# small preset; the optimizer-step benchmark. Logs to $OUT/log.txt.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
T=tests/ops/test_kda_triton.py
{
step 100 python3 benchmarks/sessions/k16_diag.py
step 110 python3 -m pytest -q --tb=line -p no:cacheprovider $T -k "matches_fp64_recurrence or layer_triton_matches or layer_training or bwd_k_split or both_splits" --deselect "$T::test_prepare_split_matches_fp64_recurrence[varlen]"
step 110 python3 -m pytest -q --tb=line -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py tests/gpu/test_fast_paths.py -k "kda or tiny_model or chunked or grouped"
step 150 python3 benchmarks/train_throughput.py --presets small --seq-lens 4096 8192 --tokens 16384 --steps 2 \
    --kda-impl triton --variants fast --time-budget 130 --json "$OUT/throughput.json"
[ -f benchmarks/optimizer_step.py ] && step 60 python3 -m benchmarks.optimizer_step --out "$OUT"
} 2>&1 | tee "$OUT/log.txt"
