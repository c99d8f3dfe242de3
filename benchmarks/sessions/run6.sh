#!/usr/bin/env bash
# Issue 5 on one H200, under ten minutes: the KDA kernel variants of docs/kda-kernels.md §7 items 9-10 and §8
# step 0, each timed with the per-kernel profile against the default launch configs. Logs to $OUT/log.txt.
#     OUT=/tmp/out bash benchmarks/kda_session.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
kda() { step 70 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --profile \
    --cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96" "$@"; }
{
# the split _prepare's kernels compiled for real (the interpreter runs a while-loop form of one of its loops)
step 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_kda_triton.py -k "prepare_split or saved_intermediates"
kda                                                        # the defaults
kda --tuning '{"prepare_split": true}'                     # three-kernel _prepare
kda --tuning '{"prepare_split": true, "prep_intra_maxnreg": null}'
kda --tuning '{"prepare_maxnreg": 128, "bwd_k_maxnreg": 128}'   # more programs per SM, some spills
kda --tuning '{"state_maxnreg": 168, "state_bwd_maxnreg": 168}'
step 45 python3 -m benchmarks.short_conv --profile
} 2>&1 | tee "$OUT/log.txt"
