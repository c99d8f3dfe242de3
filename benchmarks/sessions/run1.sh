set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
step 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fast_paths.py -k "chunked or short_conv or grouped or tiny_model"
step 50 python3 -m benchmarks.short_conv
step 60 python3 -m benchmarks.cross_entropy
step 150 python3 benchmarks/profile_step.py --preset small --rows 2 --seq-len 4096 --set kda_impl=triton loss_impl=triton --by-line --top 30
step 160 python3 benchmarks/train_throughput.py --presets small --seq-lens 4096 --tokens 16384 --kda-impl triton --variants fast fast-ckpt --set loss_impl=triton --json $OUT/tp.json
step 90 python3 -m benchmarks.kda --profile --fla-configs 1 --cases "fwd+bwd B=1 T=8192 H=96" --fla-cases "fwd+bwd B=1 T=8192 H=96"
