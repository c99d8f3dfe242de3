# session 6, H200 run 2b: the training step (MFU at 4K and 8K, with and without checkpointing, 4 micro-batches)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 220 python3 benchmarks/train_throughput.py --presets small --seq-lens 4096 8192 --tokens 16384 --kda-impl triton --variants fast fast-ckpt --set loss_impl=triton --json $OUT/tp.json
step 90 python3 benchmarks/train_throughput.py --presets small --seq-lens 4096 --tokens 16384 --micro-batches 4 --kda-impl triton --variants fast --set loss_impl=triton --json $OUT/tp-mb4.json
step 150 python3 benchmarks/profile_step.py --preset small --rows 2 --seq-len 4096 --set kda_impl=triton loss_impl=triton --by-line --top 40
} 2>&1 | tee $OUT/log.txt | grep -v "^\s*$" | grep -v Warning
