# session 6, H200 run 5: the whole-model GPU test, then the MFU table (reference vs fast at 4K and 8K, with and
# without checkpointing) and the per-path ablations at 4K, all on the final code of the session
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fast_paths.py -k "tiny_model"
step 320 python3 benchmarks/train_throughput.py --presets small --seq-lens 4096 8192 --tokens 16384 --steps 2 --kda-impl triton --variants reference fast fast-ckpt --ablate-at 4096 --time-budget 290 --json $OUT/tp.json
} 2>&1 | tee $OUT/log.txt | grep -v "^\s*$" | grep -v Warning
