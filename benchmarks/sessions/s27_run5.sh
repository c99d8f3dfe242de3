#!/usr/bin/env bash
# Session 27, run 5 (one H200, the session's last ~250 s of device time): the KDA GPU tests that run the score
# backward under `bwd_k_maxnreg` 64 (runs 3-4: `_bwd_k_block` 2.53 → 2.48-2.49 ms), set in this copy of the tree.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s27_run5.sh
. benchmarks/sessions/prelude.sh
sed -i 's/"bwd_k_maxnreg": 72,/"bwd_k_maxnreg": 64,/' k3/ops/kda/triton_common.py
grep -c '"bwd_k_maxnreg": 64,' k3/ops/kda/triton_common.py
{
step 170 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py tests/ops/test_kda_triton.py \
    -k "key_slices or fp64 or kept_norms or saved or varlen_tiny"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | tail -c 4000
