#!/usr/bin/env bash
# Session 8, KDA run: the kernel tests on the H200 under the new defaults (gate pre-pass, value-side backward
# over key slices, `_state` at 8 warps when it stores Ũ; the losing variants deleted), launch configs at the K3
# and small-preset shapes, then issue 5's table with fla side by side.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 90 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/compare.json" \
    --compare-shapes "1,8192,96;4,4096,8" --compare '[{}, {"state_ut_warps": 4}, {"prep_gate_warps": 1}]'
step 120 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 270 python3 -m pytest -v --tb=line -p no:cacheprovider tests/ops/test_kda_triton.py tests/gpu/test_kda_triton_gpu.py
} 2>&1 | grep -v "Warning\|warn_once" | tee "$OUT/log.txt"
