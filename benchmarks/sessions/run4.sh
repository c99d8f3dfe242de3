# session 6, H200 run 4: the tiny-model gradient-budget diagnostic, the loss benchmark, then the 50-step loss
# curves (fast vs reference)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 120 python3 benchmarks/sessions/tiny_margin.py
step 60 python3 -m benchmarks.cross_entropy
step 240 python3 benchmarks/train_throughput.py --presets small --seq-lens 4096 --tokens 16384 --steps 1 --kda-impl triton --variants fast --loss-steps 50 --loss-tokens 4096 --json $OUT/loss.json
} 2>&1 | tee $OUT/log.txt | grep -v "^\s*$" | grep -v Warning
