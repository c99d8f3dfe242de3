# session 6, H200 run 2: GPU tests of the changed paths, then the MoE, short-conv, KDA and step measurements
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fast_paths.py tests/gpu/test_kda_triton_gpu.py -k "grouped or short_conv or chunked or situ or tiny_model or forward"
step 40 python3 -m benchmarks.short_conv
step 60 python3 -m benchmarks.moe_grouped_gemm
step 80 python3 -m benchmarks.kda --fla-configs 1 --profile --cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96" --fla-cases "none"
step 200 python3 benchmarks/train_throughput.py --presets small --seq-lens 4096 8192 --tokens 16384 --kda-impl triton --variants fast fast-ckpt --set loss_impl=triton --json $OUT/tp.json
step 80 python3 benchmarks/train_throughput.py --presets small --seq-lens 4096 --tokens 16384 --micro-batches 4 --kda-impl triton --variants fast --set loss_impl=triton --json $OUT/tp-mb4.json
} 2>&1 | tee $OUT/log.txt | grep -v "^\s*$" | grep -v Warning
