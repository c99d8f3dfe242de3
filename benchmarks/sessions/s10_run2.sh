#!/usr/bin/env bash
# Session 10, run 2 (one H200, < 10 min): the fused two-phase AttnRes (its block benchmark, the GPU tests, the
# 32K-token step with it under "auto" and with the fused direct read), the KDA state-pass settings for few
# programs at three shapes, then where a 32K-token step goes now. Log: $OUT/log.txt.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s10_run2.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768"
{
step 45 python3 -m benchmarks.attn_res
step 100 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py -k "attn_res or tiny_model or host_token"
step 120 $TP --seq-lens 4096 --steps 5 --json "$OUT/throughput32k-two-phase.json"
step 70 $TP --seq-lens 4096 --steps 5 --set attn_res_impl=triton --json "$OUT/throughput32k-direct.json"
step 90 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/kda-few.json" \
    --compare '[{}, {"state_ut_bv": 64, "state_bwd_warps": 4, "state_bwd_stages": 2}]' \
    --compare-shapes "8,4096,8;2,16384,16;1,32768,32"
step 130 python3 benchmarks/profile_step.py --preset small --rows 8 --seq-len 4096 --steps 2 --set kda_impl=triton \
    loss_impl=triton --by-line --top 12
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 11000 "$OUT/log.txt"
