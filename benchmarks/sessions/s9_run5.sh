#!/usr/bin/env bash
# Session 9, run 5 (one H200, < 10 min): the KDA tests at full shapes on the new defaults (split-bf16 `_state`,
# kept norms, the prefetching `_bwd_vv`, one-anchor `_prep_intra`, the `_bwd_vk`/`_bwd_vv` launch settings), the
# K3-shape times with fla, the 32K-token MFU row, then flex attention's backward launch options at the small
# preset's MLA shape (its backward ran at ~150 TFLOP/s in run 2's profile). At most 8 files come back: logs only.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s9_run5.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 260 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py tests/gpu/test_kda_triton_gpu.py
step 60 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" --cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96"
step 120 python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768 \
    --seq-lens 4096 --steps 5 --json "$OUT/throughput32k.json"
step 100 python3 benchmarks/flex_options.py --options '[{},
 {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "bwd_num_stages": 3, "bwd_num_warps": 4},
 {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "bwd_num_stages": 3, "bwd_num_warps": 4},
 {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "bwd_num_stages": 2, "bwd_num_warps": 8}]'
} 2>&1 | grep -v "Warning\|warn_once" | tee "$OUT/log.txt"
