#!/usr/bin/env bash
# Issue 5 on one H200, under ten minutes: the KDA kernels' tests on the GPU, launch configs side by side in one
# process at the K3 shape and at the small preset's KDA layer (docs/kda-kernels.md §8), then the table with
# fla. Logs to $OUT/log.txt, JSON to $OUT. Pass the commit in (the GPU machine's .git copy can be stale):
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/kda_session.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 100 python3 -m pytest -q --tb=line -p no:cacheprovider tests/ops/test_kda_triton.py -k "prepare_matches or key_slices"
# the K3 shape: each config ~10 s (docs/kda-kernels.md §8: the largest kernels are _bwd_k, _bwd_vk, the state
# passes); then the small preset's KDA layer. state_bv 16 faults (session 8 run 1): not in the list.
step 170 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/compare.json" --compare '[
 {},
 {"state_ut_bv": 64},
 {"state_ut_bv": 64, "state_ut_stages": 1},
 {"state_bv": 64, "state_warps": 8},
 {"bwd_vk_warps": 8, "bwd_vk_maxnreg": 128},
 {"bwd_k_cols": 64, "bwd_k_warps": 8},
 {"bwd_k_maxnreg": 168},
 {"state_bwd_warps": 4}
]'
step 100 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/compare_small.json" \
    --compare-shapes "2,8192,8;4,4096,8" --compare '[{}, {"state_ut_bv": 64}, {"state_bwd_warps": 4}]'
# the table, fla side by side (one config per fla autotuner: a full autotune takes minutes per shape)
step 200 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
} 2>&1 | tee "$OUT/log.txt"
