#!/usr/bin/env bash
# Session 18, run 4 (one H200, the session's last device minutes): the streaming short conv (its g window fixed) on
# the GPU's tests and timed against the tile kernels; the one-warp AttnRes reads and the tiny model against the
# reference stack; then the 64K-token MFU rows on this code (flex 32/128/128/32 at 3 stages + 128x64 forward,
# AttnRes one row per warp, 1 GiB loss chunks), with the conv's fastest stream setting if it passed its gate.
#     OUT=/tmp/out bash benchmarks/sessions/s18_run4.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 60 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_short_conv.py -k "stream"
step 80 python3 -m benchmarks.short_conv --stream 128x1024x4x3 128x512x2x3 256x512x2x3 256x256x1x4
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py -k "attn_res or tiny_model"
step 45 python3 -m benchmarks.norm
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
# the fastest stream setting at the 64K-token shape (forward + backward), if any passed
BEST=$(python3 - "$OUT/log.txt" <<'PY'
import re, sys
best = {}
for line in open(sys.argv[1]):
    m = re.match(r"\[stream\] (\S+) T=65536 C=1024: fwd (\d+) us .*bwd (\d+) us", line)
    if m:
        best[m.group(1)] = int(m.group(2)) + int(m.group(3))
tiles = best.pop("tiles", None)
pick = min(best, key=best.get) if best else None
print(pick if pick and tiles and best[pick] < tiles else "")
PY
)
echo "stream setting for the MFU rows: '${BEST}'" >> "$OUT/log.txt"
TP="benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 65536"
{
step 170 python3 benchmarks/sessions/with_conv_stream.py "$BEST" $TP --seq-lens 4096 --steps 2 --micro-batches 4 --json "$OUT/throughput64k_mb4.json"
step 90 python3 benchmarks/sessions/with_conv_stream.py "$BEST" $TP --seq-lens 8192 --steps 2 --micro-batches 4 --json "$OUT/throughput64k_8k_mb4.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" >> "$OUT/log.txt"
grep -v "^ \|^---\|^│\|^┃\|^┏\|^┡\|^└" "$OUT/log.txt" | grep -v "^\s*$" | tail -c 7000
