#!/usr/bin/env bash
# Session 10, run 1 (one H200, < 9 min): compute-sanitizer on the state_bv 16 fault, then each config of
# s10_configs.txt in its own process at the K3 shape and the small preset's 32K-token KDA shape (8 × 4096, H = 8).
# Every compare row goes to $OUT/compare.jsonl; the log to $OUT/log.txt.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s10_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
CONFIGS=${1:-benchmarks/sessions/s10_configs.txt}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 70 compute-sanitizer --tool memcheck --print-limit 4 python3 -m benchmarks.kda --quick --fla-cases none \
    --cases none --compare '[{"state_bv": 16}]' --compare-shapes "1,300,2"
while IFS= read -r cfg; do
    [ -z "$cfg" ] && continue
    step 60 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/one.json" \
        --compare "[$cfg]" --compare-shapes "1,8192,96;8,4096,8" && python3 -c "
import json, sys
for row in json.load(open(sys.argv[1]))['compare']:
    print(json.dumps(row))" "$OUT/one.json" >> "$OUT/compare.jsonl"
done < "$CONFIGS"
rm -f "$OUT/one.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
