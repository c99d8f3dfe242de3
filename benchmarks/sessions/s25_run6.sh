#!/usr/bin/env bash
# Session 25, run 6 (one H200): `_bwd_k_pair` (two row blocks per program, each neighbour's tiles loaded once for
# both; offline sm_90: 128 B of spills at 128 registers = 4 programs, 8 blocks per SM against `_bwd_k_block`'s 7;
# 260 B at 96 = 5 programs) on the GPU against the single blocks, then timed beside backward launch knobs that
# keep each kernel's programs per SM offline: `_bwd_vk` at 5 stages (208 KB), `_bwd_vv` at 4 (104 KB, two per SM),
# the training `_state` storing Ũ at 4 (168 KB), `_bwd_k_block` on 64-column slices at 8 warps. Each config is
# gated against fp64 before it is timed.
#     OUT=/tmp/out bash benchmarks/sessions/s25_run6.sh
. benchmarks/sessions/prelude.sh
{
step 60 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "row_block_pairs"
step 330 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/s25_run6_compare.json" \
    --compare '[{}, {"bwd_k_pairs": true, "bwd_k_pair_maxnreg": 128}, {"bwd_k_pairs": true, "bwd_k_pair_maxnreg": 96},
                {"bwd_k_pairs": true, "bwd_k_pair_maxnreg": 80}, {"bwd_vk_stages": 5}, {"bwd_vv_stages": 4},
                {"state_ut_stages": 4}, {"bwd_k_cols": 64, "bwd_k_warps": 8}, {}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
