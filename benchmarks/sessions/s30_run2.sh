#!/usr/bin/env bash
# Session 30, run 2 (one H200), prepared in session 29: the KDA GPU tests that cover `state_bwd_qprime` (§7 item 65),
# `_fwd_o` (its split products, and `fwd_o_loop`, item 66) and the 32-row score backward (`bwd_k_rows`, item 67);
# then, at the K3 shape beside the defaults, `_fwd_o` as one program per (chunk, head) walking the value blocks at
# three launches and `_bwd_k_block` on 32-row blocks at four (offline: 16-column slices on 4 warps 150 registers
# uncapped, 32 B of spills at 128, 160 B at 96; 64-column slices on 8 warps 168 uncapped, 80 B at 128, a quarter of
# today's programs), and the training `_state` (o apart
# since session 28) on value blocks of 64 at 8 warps (offline 234-240 registers, no spills, 112 KB at 2 stages, 160 at
# 3: half the programs, 192 on 132 SMs). No accuracy table: o is bit-identical under `fwd_o_loop`, and the 32-row
# gradients match the 16-row ones to 1e-4 (tested); a `_state` launch at 8 warps is untested on the H200 (split
# products at 8 warps were miscompiled at 1 stage in `_state_bwd`, §7 item 20): run the GPU tests before adopting it.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s30_run2.sh
. benchmarks/sessions/prelude.sh
{
step 200 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
    -k "qprime or saved_intermediates_match or output_apart or bf16_storage or 32_row"
step 300 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/s30_run2_compare.json" \
    --compare '[{}, {"fwd_o_loop": true}, {"fwd_o_loop": true, "fwd_o_stages": 2}, {"fwd_o_loop": true, "fwd_o_bv": 32},
                {"bwd_k_rows": 32, "bwd_k_cols": 16, "bwd_k_maxnreg": 128},
                {"bwd_k_rows": 32, "bwd_k_cols": 16, "bwd_k_maxnreg": 96},
                {"bwd_k_rows": 32, "bwd_k_cols": 64, "bwd_k_warps": 8, "bwd_k_maxnreg": 128},
                {"bwd_k_rows": 32, "bwd_k_cols": 64, "bwd_k_warps": 8, "bwd_k_maxnreg": null},
                {"state_ut_bv": 64, "state_ut_warps": 8, "state_ut_stages": 2},
                {"state_ut_bv": 64, "state_ut_warps": 8, "state_ut_stages": 3}, {}]' \
    --compare-shapes '1,8192,96'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
