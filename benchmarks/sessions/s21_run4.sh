#!/usr/bin/env bash
# Session 21, run 4 (one H200): the KDA prefill tests and the GPU file on the final code (run 3's 120 s were short).
#     OUT=/tmp/out bash benchmarks/sessions/s21_run4.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
timeout 190 python3 -m pytest -q --tb=short -p no:cacheprovider tests/ops/test_kda_triton.py \
    tests/gpu/test_kda_triton_gpu.py -k "prefill or gpu or full" 2>&1 | grep -v "Warning\|warn_once" > "$OUT/log.txt"
echo "exit $?" >> "$OUT/log.txt"
tail -c 6000 "$OUT/log.txt"
