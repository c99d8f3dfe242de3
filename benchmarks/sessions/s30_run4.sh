#!/usr/bin/env bash
# Session 30, run 4 (one H200), prepared in session 30 (no device lent then). Two backward launches folded into the
# kernel before them by the split-K pattern (the program that finishes last does the reduction, found by an atomic
# count; docs/kda-kernels.md §7 items 70-71): `_bwd_gate`'s reverse cumsum and gate chain inside `_bwd_k_block`
# (`bwd_gate_fused`) and `_bwd_vv`'s work inside `_bwd_vk` (`bwd_vv_fused`). Their GPU tests first: outputs and
# gradients equal to the separate launches' (to 1e-6 and 1e-5: the chains compile inside other kernels) on
# NaN-filled allocations, which is what tries the counts' memory ordering (the interpreter runs programs one after
# another). Then timed beside the defaults, alone, together and with the sums from the scores (`norms_from_scores`,
# item 69), at the K3 shape and the small preset's; no accuracy table (the gradients are those of the separate
# launches). Predictions at the K3 shape: −0.2 ms (gate: `_bwd_gate`'s 0.38 less the chain inside `_bwd_k_block`, whose
# spills grow 112 → 148 B at its 64-register cap offline) and −0.25 ms (value chain: `_bwd_vv`'s 0.65 less the chain
# inside `_bwd_vk`, 212 → 255 registers, no spills).
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s30_run4.sh
. benchmarks/sessions/prelude.sh
{
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
    -k "gate_chain_in_score or value_chain_in_key"
step 400 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/s30_run4_compare.json" \
    --compare '[{}, {"bwd_gate_fused": true}, {"bwd_vv_fused": true}, {"bwd_gate_fused": true, "bwd_vv_fused": true},
                {"bwd_gate_fused": true, "bwd_vv_fused": true, "norms_from_scores": true},
                {"bwd_gate_fused": true, "bwd_vv_fused": true, "norms_from_scores": true, "state_bwd_qprime": true},
                {}]' \
    --compare-shapes '1,8192,96;4,4096,8'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
