#!/usr/bin/env bash
# Session 24, run 1 (one H200): the inference state pass at BV 128 on 8 warps as the default (session 23 run 4's
# probe), with the dispatch rules counted at BV 64. The KDA GPU tests on it, issue 5's table with fla, then the
# inference forward's launch knobs around the new default, interleaved (segments, the prepare's warps, the state
# pass's stages, and its register cap: at 208 registers on 8 warps a state program leaves room for one 4-warp
# prepare program of 96 on its SM, at 160 (4 B of spills offline) for two). Then two backward code variants against the previous code (.old/, a `git archive` of HEAD),
# back to back: `_bwd_k_block` walking its neighbouring blocks in loops with run-time bounds (pipelined loads,
# cp.async) instead of an unrolled loop of plain loads, and `_bwd_vk` loading T and G before its value loop instead
# of after; .var/ also has `_bwd_k_block` loading its fp32 scratch (the value side's dq̂, dk̂, dG) at its start.
# The training state pass at BV 64 on 8 warps (two value blocks per program share the step's W, Q_g and K_d tiles)
# as a knob.
# Two device calls (the per-call limit): part a, the tests, the table and the forward probe; part b, the backward.
#     OUT=/tmp/out bash benchmarks/sessions/s24_run1.sh a|b
. benchmarks/sessions/prelude.sh
ROOT=$PWD
compare() {  # $1: tree, $2: configs
    (cd "$1" && PYTHONPATH=$PWD step 150 python3 -m benchmarks.kda --fla-cases none --cases none --compare "$2")
}
{
if [ "${1:-a}" = a ]; then
PYTHONPATH=$ROOT step 200 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py \
    tests/ops/test_kda_triton.py -k "prefill or pipeline or segment or head_dims or gpu or key_slices or fp64"
step 200 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
step 240 python3 benchmarks/sessions/s22_pipeline_probe.py --rounds 2 --no-accuracy --out "$OUT/s24_run1_probe.json" \
    --configs '[{}, {"prefill_state_bv": 64}, {"prefill_segment_tokens": 2731}, {"prefill_segment_tokens": 1639},
                {"prefill_state_maxnreg": 160}, {"prefill_state_maxnreg": 152}, {"prefill_prepare_warps": 8},
                {"prefill_state_stages": 2}, {"prefill_state_stages": 4}]'
else
compare "$ROOT/.old" '[{}]'
compare "$ROOT" '[{}, {"state_ut_bv": 64, "state_ut_warps": 8}, {"bwd_k_maxnreg": 80}]'
compare "$ROOT/.var" '[{}]'
compare "$ROOT/.old" '[{}]'
fi
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^│\|^┃\|^┏\|^┡\|^└" | tail -c 11500
