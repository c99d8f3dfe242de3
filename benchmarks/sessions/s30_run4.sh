#!/usr/bin/env bash
# Session 30, run 4 (one H200), prepared in session 30 (no device lent then). `_bwd_gate`'s reverse cumsum and gate
# chain run by the last of a chunk's row blocks to finish on each key slice, inside `_bwd_k_block`
# (`bwd_gate_fused`, docs/kda-kernels.md §7 item 70: an atomic count per chunk, head and slice, dG read back from
# L2). Its GPU test first: the outputs and gradients must be bit-identical to the separate launch's, which is what
# tries the count's memory ordering (the interpreter runs programs one after another). Then timed beside the
# defaults, alone and with the sums from the scores (`norms_from_scores`, item 69, which also changes
# `_bwd_k_block`), at the K3 shape and the small preset's; no accuracy table, the gradients being bit-identical.
# Prediction: −0.38 ms (`_bwd_gate`) + ~0.1-0.15 (the chain inside `_bwd_k_block`, whose spills grow 112 → 148 B at
# its 64-register cap offline): −0.2 ms at the K3 shape.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s30_run4.sh
. benchmarks/sessions/prelude.sh
{
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "gate_chain_in_score"
step 360 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/s30_run4_compare.json" \
    --compare '[{}, {"bwd_gate_fused": true}, {"bwd_gate_fused": true, "bwd_k_maxnreg": 72},
                {"bwd_gate_fused": true, "norms_from_scores": true}, {}]' \
    --compare-shapes '1,8192,96;4,4096,8'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
