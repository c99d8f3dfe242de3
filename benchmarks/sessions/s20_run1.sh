#!/usr/bin/env bash
# Session 20, run 1 (one H200): the untimed opt-ins of session 19 against the defaults, interleaved in one process
# (benchmarks/step_ab.py: AttnRes read-and-pass, the chunked one-warp backward, both); what gradient accumulation
# costs per micro-batch; then the GPU tests written in session 19 and not yet run, and the rest of
# test_fast_paths.py.
#     OUT=/tmp/out bash benchmarks/sessions/s20_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 280 python3 -m benchmarks.step_ab --seq-len 4096 --tokens 65536 --micro-batches 4 --rounds 5 \
    --settings "" "attn_res.READ_OPTIONS.pass_partial=True" "attn_res.READ_TILES.chunk=256" \
    "attn_res.READ_OPTIONS.pass_partial=True;attn_res.READ_TILES.chunk=256" --json "$OUT/ab4096.json"
step 40 python3 benchmarks/sessions/s20_accum_probe.py
step 230 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py \
    -k "read_and_pass or kda_gate_slice or not (rms_norm or tiny_model_fast or attn_res_chunked or mla_attention)"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^ \|^---\|^│\|^┃\|^┏\|^┡\|^└" "$OUT/log.txt" | grep -v "^\s*$" | tail -c 9000
grep "^│\|^┃" "$OUT/log.txt" | tail -8
