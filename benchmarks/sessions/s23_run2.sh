#!/usr/bin/env bash
# Session 23, run 2 (one H200): the state passes with G_C loaded one step ahead (`_load_gamma`; run 1's Nsight
# Compute samples put 42% of the inference state pass's stalls on that load). The KDA GPU tests on the new code,
# then the k3 rows of issue 5's table and the fwd+bwd kernel profile, on the code before the change (.old/, a
# `git archive` of the previous commit's k3/ and benchmarks/) and after, back to back; then the inference forward
# interleaved at one segment and pipelined.
#     OUT=/tmp/out bash benchmarks/sessions/s23_run2.sh
. benchmarks/sessions/prelude.sh
ROOT=$PWD
table() {  # $1: tree, $2: tag
    (cd "$1" && PYTHONPATH=$PWD step 120 python3 -m benchmarks.kda --fla-cases none --out "$OUT/kda-$2.json")
    (cd "$1" && PYTHONPATH=$PWD step 90 python3 -m benchmarks.kda --fla-cases none --cases none --profile)
}
{
PYTHONPATH=$ROOT step 200 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py \
    tests/ops/test_kda_triton.py -k "pipeline or prefix_caching or segment or gpu or graph or full or state"
table "$ROOT/.old" before
table "$ROOT" after
table "$ROOT/.old" before2
PYTHONPATH=$ROOT step 120 python3 benchmarks/sessions/s22_pipeline_probe.py --rounds 2 --no-accuracy \
    --out "$OUT/s23_run2_probe.json" --configs '[{}, {"prefill_segments": 1}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 11500
