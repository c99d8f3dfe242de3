#!/usr/bin/env bash
# Session 11, run 3 (one H200, ~7 min): PyTorch's FlashAttention varlen entry point against flex_attention at the
# small preset's MLA shape (forward, backward, agreement); the MFU rows at 8K tokens per sequence and with 4
# micro-batches on this session's code (Triton weight-gradient GEMMs in the MoE).
#     K3_GIT_SHA=$(git rev-parse HEAD) OUT=/tmp/out bash benchmarks/sessions/s11_run3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
TP="python3 benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 32768"
{
python3 -c "import torch; print('torch', torch.__version__)"
step 150 python3 benchmarks/flex_options.py --options '[{}, {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "bwd_num_stages": 2, "bwd_num_warps": 8}]' --varlen
step 200 $TP --seq-lens 8192 --steps 3 --json "$OUT/throughput32k-8k.json"
step 150 $TP --seq-lens 4096 --steps 2 --micro-batches 4 --json "$OUT/throughput32k-mb4.json"
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
tail -c 9000 "$OUT/log.txt"
