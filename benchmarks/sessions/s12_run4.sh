#!/usr/bin/env bash
# Session 12, run 4 (one H200, < 7 min): the Ũ launch at BV 64 / 2 stages (few-programs rule) against BV 32 / 3
# stages at the small preset's shape; the inference `_state` in split bf16 at 3 stages; the KDA GPU tests; the
# MFU row at 4K with the GPU's SM clock and power sampled by nvidia-smi during the steps (why kernels run slower
# in the step than alone: session 11).
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s12_run4.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 150 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/kda-compare.json" \
    --compare '[{}, {"few_programs": {}}, {"state_split_inference": true, "state_stages": 3}]' \
    --compare-shapes "1,8192,96;8,4096,8"
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 200 > "$OUT/smi.csv" 2>&1 &
SMI=$!
step 170 python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768 \
    --seq-lens 4096 --steps 5 --json "$OUT/throughput32k.json"
kill $SMI
python3 - "$OUT/smi.csv" <<'PY'
import csv, sys, statistics
rows = [r for r in csv.reader(open(sys.argv[1])) if r and r[0][:2] == "20"]
sm = [float(r[1].split()[0]) for r in rows]
pw = [float(r[3].split()[0]) for r in rows]
print(f"nvidia-smi: {len(rows)} samples; SM clock MHz min {min(sm):.0f} median {statistics.median(sm):.0f} "
      f"max {max(sm):.0f}; power W median {statistics.median(pw):.0f} max {max(pw):.0f}")
busy = [r for r in rows if float(r[3].split()[0]) > 300]
if busy:
    print(f"  at > 300 W ({len(busy)} samples): SM clock median {statistics.median(float(r[1].split()[0]) for r in busy):.0f}"
          f" MHz; throttle reasons {sorted(set(r[5].strip() for r in busy))}")
PY
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
