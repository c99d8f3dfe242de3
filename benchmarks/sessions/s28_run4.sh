#!/usr/bin/env bash
# Session 28, run 4 (one H200): run 3's one failing GPU test (the kept-against-recomputed comparison, whose o now
# differs by design where `state_o_apart` applies) after its fix, with the other tests of the session's switches.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s28_run4.sh
. benchmarks/sessions/prelude.sh
{
step 200 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
    -k "saved_intermediates_match or output_apart or bf16_storage"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 11500
