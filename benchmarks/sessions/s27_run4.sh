#!/usr/bin/env bash
# Session 27, run 4 (one H200): `_bwd_k_block` with one program per (key slice, chunk) walking the four row blocks
# (`bwd_k_chunked`: the neighbours' tiles it loaded for one block come from L1 for the next) at the register caps
# it fits (offline sm_90: 72 → 304 B of spills, 80 → 188, 88 → 72, 96 → none), against the defaults; then the
# KDA GPU tests of the score backward with it switched on in this copy of the tree.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s27_run4.sh
. benchmarks/sessions/prelude.sh
{
step 150 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/s27_run4_compare.json" \
    --compare-shapes "1,8192,96;4,4096,8" \
    --compare '[{}, {"bwd_k_chunked": true, "bwd_k_maxnreg": 96}, {"bwd_k_chunked": true, "bwd_k_maxnreg": 88},
                {"bwd_k_chunked": true, "bwd_k_maxnreg": 128}, {"bwd_k_maxnreg": 64}, {}]'
sed -i 's/"bwd_k_chunked": False,/"bwd_k_chunked": True,/; s/"bwd_k_maxnreg": 72,/"bwd_k_maxnreg": 96,/' \
    k3/ops/kda/triton_common.py
step 240 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py tests/ops/test_kda_triton.py \
    -k "one_program_per_chunk or key_slices or fp64 or varlen_tiny or kept_norms"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 11500
