#!/usr/bin/env bash
# Session 11, run 4 (one H200, ~6 min): Nsight Compute counters for the short conv's three kernels at 32K tokens
# (0.43 ms per backward against ~0.11 ms of bytes); where a 32K-token step goes on this session's code.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s11_run4.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 150 ncu --clock-control none --profile-from-start off --set full --import-source no \
    -k 'regex:_conv_silu' --kernel-name-base function -f -o /tmp/conv python3 -m benchmarks.short_conv_ncu
ncu -i /tmp/conv.ncu-rep --page details --csv > "$OUT/conv_details.csv"
{ ncu -i /tmp/conv.ncu-rep --page source --csv --print-source sass 2>&1; } | gzip > "$OUT/conv_source.csv.gz"
python3 - "$OUT/conv_details.csv" <<'PY'
import csv, sys, collections
rows = list(csv.DictReader(open(sys.argv[1])))
want = ["Duration", "DRAM Throughput", "Memory Throughput", "L2 Hit Rate", "L1/TEX Hit Rate", "Issue Slots Busy",
        "Achieved Occupancy", "Theoretical Occupancy", "Registers Per Thread", "Compute (SM) Throughput",
        "Executed Ipc Active", "DRAM Frequency", "Block Limit Registers", "Waves Per SM"]
table = collections.OrderedDict()
for r in rows:
    if r["Metric Name"] in want:
        table.setdefault((r["ID"], r["Kernel Name"]), {})[r["Metric Name"]] = r["Metric Value"] + " " + r["Metric Unit"]
for (i, name), m in table.items():
    print(i, name)
    for k in want:
        print("   ", k, "=", m.get(k, ""))
for r in rows:  # the rule findings (stall reasons, uncoalesced accesses)
    if r.get("Rule Name") and r.get("Rule Type") in ("WRN", "OPT") and r.get("Rule Description"):
        print(r["ID"], r["Rule Name"], ":", r["Rule Description"][:400])
PY
step 150 python3 benchmarks/profile_step.py --preset small --rows 8 --seq-len 4096 --steps 3 --set kda_impl=triton \
    loss_impl=triton --by-line --top 20
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 14000 "$OUT/log.txt"
