#!/usr/bin/env bash
# Session 19, run 3 (one H200, the session's last device minutes): the GPU tests that cover this session's
# changes (norm full shapes with the backward's measured rule, the tiny model's fast stack against the reference
# with the MLA keys pair, the split projections' backward and strided norm rows, the chunked AttnRes backward);
# then the 64K x 4 MFU row at the new defaults, and with the AttnRes chunked backward (chunk 256: 1.52x at 3
# sealed sources in run 2's tiles, 0.99x at 7).
#     OUT=/tmp/out bash benchmarks/sessions/s19_run3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 65536"
{
step 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py \
    -k "rms_norm or tiny_model or attn_res_chunked or mla_attention"
step 190 python3 $TP --seq-lens 4096 --steps 2 --micro-batches 4 --json "$OUT/throughput64k_mb4.json"
step 170 python3 benchmarks/sessions/with_settings.py "attn_res.READ_TILES.chunk=256" $TP --seq-lens 4096 --steps 2 \
    --micro-batches 4 --json "$OUT/throughput64k_mb4_chunk256.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^ \|^---\|^│\|^┃\|^┏\|^┡\|^└" "$OUT/log.txt" | grep -v "^\s*$" | tail -c 9000
