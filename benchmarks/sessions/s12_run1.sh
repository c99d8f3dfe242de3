#!/usr/bin/env bash
# Session 12, run 1 (one H200, < 9 min): the state passes' product variants (TUNING "state_bwd_products" tf32 /
# split / bf16, "state_bf16"), each config in its own process (a fault cannot take the others) at the K3 shape
# and the small preset's 32K-token KDA shape; their GPU test; compute-sanitizer on the bf16 backward state pass.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s12_run1.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 90 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "state_bwd_products"
while IFS= read -r cfg; do
    [ -z "$cfg" ] && continue
    step 65 python3 -m benchmarks.kda --fla-cases none --cases none --out "$OUT/one.json" \
        --compare "[$cfg]" --compare-shapes "1,8192,96;8,4096,8" && python3 -c "
import json, sys
for row in json.load(open(sys.argv[1]))['compare']:
    print(json.dumps(row))" "$OUT/one.json" >> "$OUT/compare.jsonl"
done <<'CONFIGS'
{}
{"state_bwd_products": "split"}
{"state_bwd_products": "split", "state_bwd_warps": 4, "state_bwd_stages": 2}
{"state_bwd_products": "bf16", "state_bwd_warps": 4, "state_bwd_stages": 2}
{"state_bwd_products": "bf16"}
{"state_bf16": true, "state_bwd_products": "bf16", "state_bwd_warps": 4, "state_bwd_stages": 2}
CONFIGS
rm -f "$OUT/one.json"
step 80 compute-sanitizer --tool memcheck --print-limit 4 python3 -m benchmarks.kda --quick --fla-cases none \
    --cases none --compare '[{"state_bwd_products": "bf16"}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
