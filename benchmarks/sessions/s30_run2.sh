#!/usr/bin/env bash
# Session 30, run 2 (one H200), prepared in session 29: `_fwd_o` as one program per (chunk, head) walking the value
# blocks (`fwd_o_loop`, docs/kda-kernels.md §7 item 66) at four launches beside the defaults, at the K3 shape and the
# small preset's; no accuracy table (o is bit-identical, tested), then the `_fwd_o` GPU test (which runs the loop too).
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s30_run2.sh
. benchmarks/sessions/prelude.sh
{
step 240 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/s30_run2_compare.json" \
    --compare '[{}, {"fwd_o_loop": true}, {"fwd_o_loop": true, "fwd_o_stages": 2},
                {"fwd_o_loop": true, "fwd_o_stages": 2, "fwd_o_warps": 8}, {"fwd_o_loop": true, "fwd_o_bv": 32}, {}]' \
    --compare-shapes '1,8192,96;4,4096,8'
step 90 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
    -k "output_apart"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
