#!/usr/bin/env bash
# One H200, under ten minutes: the fast paths' GPU tests, then the measurements of issues 9 and 5.
# Each step has its own time limit so that a slow one cannot take the others' time; everything printed also
# goes to $OUT/log.txt (the device returns only the tail of stdout), JSON results to $OUT. Run from the
# repository root:
#     OUT=/tmp/out bash benchmarks/one_gpu_session.sh
# Past sessions' runs, in this form: benchmarks/sessions/run*.sh, logs in benchmarks/results/logs/.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fast_paths.py tests/gpu/test_kda_triton_gpu.py \
    -k "grouped or short_conv or chunked or situ or tiny_model or norm or forward or decode"
# the short conv's per-call cost, kernel by kernel (its small-shape time hardly grows with T)
step 45 python3 -m benchmarks.short_conv --profile
# issue 5: the two main KDA shapes against fla (one config per fla autotuner: a full autotune takes minutes)
step 100 python3 -m benchmarks.kda --fla-configs 1 --profile --out "$OUT/kda.json" \
    --cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96" --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96"
# issue 9: MFU at 4K and 8K (the reference ops only fit with checkpointing), then the per-path ablations
step 250 python3 benchmarks/train_throughput.py --presets small --seq-lens 4096 8192 --tokens 16384 --steps 2 \
    --kda-impl triton --variants reference-ckpt fast fast-ckpt --ablate-at 4096 --time-budget 220 \
    --json "$OUT/throughput.json"
} 2>&1 | tee "$OUT/log.txt"
