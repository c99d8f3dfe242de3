#!/usr/bin/env bash
# Session 26, run 6 (one H200, the last device minutes): launch knobs of the two elementwise-like backward
# kernels, `_bwd_gate` (0.38 ms at the K3 shape, about half of its memory floor) and `_bwd_norms` (0.41): 2 warps
# or 64-column slices for the gate pass (untimed so far; 8 warps, 16 and 128 columns lost in session 8), 8 or 32
# rows per norms program, 8 warps. Each gated against fp64, then timed at the K3 shape.
#     OUT=/tmp/out K3_GIT_SHA=<sha> bash benchmarks/sessions/s26_run6.sh
. benchmarks/sessions/prelude.sh
{
step 140 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/s26_run6_compare.json" \
    --compare '[{}, {"bwd_gate_warps": 2}, {"bwd_gate_cols": 64}, {"bwd_norms_rows": 32}, {"bwd_norms_rows": 8},
                {"bwd_norms_warps": 8}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^┃\|^┏\|^┡\|^└" | tail -c 6000
