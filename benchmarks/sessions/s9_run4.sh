#!/usr/bin/env bash
# Session 9, run 4 (one H200, < 10 min): each KDA launch/variant config in its own process (a config that faults
# cannot take the others with it: run 3 lost five to one illegal address), then the issue's table with fla under the
# config that was fastest forward+backward at the K3 shape.
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s9_run4.sh benchmarks/sessions/s9_configs.txt
set -u
OUT=${OUT:-benchmarks/results}
CONFIGS=${1:-benchmarks/sessions/s9_configs.txt}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py -k "${TESTS:-split}"
i=0
while IFS= read -r cfg; do
    [ -z "$cfg" ] && continue
    i=$((i + 1))
    step 45 python3 -m benchmarks.kda --fla-configs 1 --fla-cases none --cases none --out "$OUT/compare$i.json" \
        --compare "[$cfg]"
done < "$CONFIGS"
best=$(python3 - "$OUT/log.partial" <<'PY'
import json, re, sys
best = min(((float(m.group(2)), m.group(1)) for m in re.finditer(r"\[compare\] B=1 T=8192 H=96 (\{.*?\}): fwd [\d.]+ ms, fwd\+bwd ([\d.]+) ms", open(sys.argv[1]).read())), default=(0, "{}"))
print(best[1])
PY
)
echo "fastest forward+backward config: $best"
step 200 python3 -m benchmarks.kda --fla-configs 1 --out "$OUT/kda.json" --tuning "$best" \
    --fla-cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" | tee "$OUT/log.partial" > "$OUT/log.txt"
cat "$OUT/log.txt" | tail -c 11000
