# session 6, H200 run 2a: GPU tests of the changed paths, then the MoE, short-conv and KDA measurements
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
step 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fast_paths.py tests/gpu/test_kda_triton_gpu.py -k "grouped or short_conv or chunked or situ or tiny_model or norm or forward or decode"
step 40 python3 -m benchmarks.short_conv
step 75 python3 -m benchmarks.moe_grouped_gemm
step 100 python3 -m benchmarks.kda --fla-configs 1 --variants --profile --cases "fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96" --fla-cases "none"
} 2>&1 | tee $OUT/log.txt | grep -v "^\s*$" | grep -v Warning
