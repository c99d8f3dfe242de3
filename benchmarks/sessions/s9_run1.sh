#!/usr/bin/env bash
# Session 9, run 1 (one H200, < 10 min): Nsight Compute counters for every KDA chunk kernel at the K3 shape
# (docs/kda-kernels.md §8 asked for them before any re-blocking), the GPU test of host token ids and of a
# train step without host waits after the update, and the 32K-token MFU row with the back-to-back column.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s9_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
which ncu; ncu --version | tail -1
step 230 ncu --clock-control none --profile-from-start off --set full --import-source no \
    -k 'regex:^_(prep|state|bwd)' --kernel-name-base function -f -o "$OUT/kda" python3 -m benchmarks.kda_ncu
ncu -i "$OUT/kda.ncu-rep" --page details --csv > "$OUT/kda_details.csv"
ncu -i "$OUT/kda.ncu-rep" --page raw --csv | gzip > "$OUT/kda_raw.csv.gz"
{ ncu -i "$OUT/kda.ncu-rep" --page source --csv --print-source sass 2>&1 || ncu -i "$OUT/kda.ncu-rep" --page source --csv 2>&1; } | gzip > "$OUT/kda_source.csv.gz"
ls -la "$OUT"
python3 - "$OUT/kda_details.csv" <<'PY'
import csv, sys, collections
rows = list(csv.DictReader(open(sys.argv[1])))
want = ["Duration", "DRAM Throughput", "Memory Throughput", "L2 Hit Rate", "L1/TEX Hit Rate", "Issue Slots Busy",
        "Achieved Occupancy", "Theoretical Occupancy", "Registers Per Thread", "Compute (SM) Throughput", "Executed Ipc Active"]
table = collections.OrderedDict()
for r in rows:
    key = (r["ID"], r["Kernel Name"])
    if r["Metric Name"] in want:
        table.setdefault(key, {})[r["Metric Name"]] = r["Metric Value"] + " " + r["Metric Unit"]
for (i, name), m in table.items():
    print(i, name, "|", " | ".join(f"{k}={m.get(k, '')}" for k in want))
PY
step 60 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_paths.py -k "host_token_ids"
step 170 python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768 \
    --seq-lens 4096 --steps 5 --json "$OUT/throughput32k.json"
} 2>&1 | grep -v "Warning\|warn_once" | tee "$OUT/log.txt"
