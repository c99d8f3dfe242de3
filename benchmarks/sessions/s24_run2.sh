#!/usr/bin/env bash
# Session 24, run 2 (one H200; the session's last device time): run 1 timed BV 128 against BV 64 for the inference
# state pass the other way round from session 23 run 4 (1.345 against 1.319 ms at the K3 shape, where run 4 had
# 1.338 against 1.379), each time with the first config slower, so this run rotates the configs' order per round
# (`--rotate`, 4 rounds). Before it, the KDA GPU tests with `_bwd_vk` loading T and G before its value loop (run 1:
# 2.64 → 2.57 ms). Then that change against the previous code (.old/, HEAD) and against also loading q and k early
# (.var/), back to back; issue 5's table with fla on the final code, its k3 rows at BV 64, and the training state
# pass at BV 64 on 8 warps at 2 stages (3 stages needed 262 KB of shared memory in run 1).
#     OUT=/tmp/out bash benchmarks/sessions/s24_run2.sh
. benchmarks/sessions/prelude.sh
ROOT=$PWD
compare() {  # $1: tree, $2: configs
    (cd "$1" && PYTHONPATH=$PWD step 100 python3 -m benchmarks.kda --fla-cases none --cases none --compare "$2")
}
{
PYTHONPATH=$ROOT step 200 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py \
    tests/ops/test_kda_triton.py -k "key_slices or fp64 or kept_norms or saved or split_call or causality"
step 150 python3 benchmarks/sessions/s22_pipeline_probe.py --rounds 4 --rotate --no-accuracy \
    --out "$OUT/s24_run2_probe.json" --configs '[{}, {"prefill_state_bv": 64}]'
compare "$ROOT/.old" '[{}]'
compare "$ROOT" '[{}]'
compare "$ROOT/.var" '[{}]'
step 150 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 90 python3 -m benchmarks.kda --fla-cases none --cases "fwd B=" --tuning '{"prefill_state_bv": 64}' \
    --out "$OUT/kda-bv64.json"
compare "$ROOT" '[{"state_ut_bv": 64, "state_ut_warps": 8, "state_ut_stages": 2}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^│\|^┃\|^┏\|^┡\|^└" | grep -v "^\[fwd.*median" | tail -c 11500
