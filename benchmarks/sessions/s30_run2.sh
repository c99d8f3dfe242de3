#!/usr/bin/env bash
# Session 30, run 2 (one H200), prepared in session 29: the KDA GPU tests that cover `state_bwd_qprime` (§7 item 65)
# and `_fwd_o` (its split products, and `fwd_o_loop`, item 66), then `_fwd_o` as one program per (chunk, head)
# walking the value blocks at four launches beside the defaults, at the K3 shape and the small preset's (no accuracy
# table: o is bit-identical, tested).
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s30_run2.sh
. benchmarks/sessions/prelude.sh
{
step 200 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
    -k "qprime or saved_intermediates_match or output_apart or bf16_storage"
step 240 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/s30_run2_compare.json" \
    --compare '[{}, {"fwd_o_loop": true}, {"fwd_o_loop": true, "fwd_o_stages": 2},
                {"fwd_o_loop": true, "fwd_o_stages": 2, "fwd_o_warps": 8}, {"fwd_o_loop": true, "fwd_o_bv": 32}, {}]' \
    --compare-shapes '1,8192,96;4,4096,8'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
