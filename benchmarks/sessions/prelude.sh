# Sourced by the session scripts (`. benchmarks/sessions/prelude.sh`, from the repository root): $OUT (default
# benchmarks/results) made, the wheels carried in .whl/ (fla-core, docs/kda-kernels.md §6) installed to /tmp/site,
# PYTHONPATH set to them and the checkout, and `step LIMIT CMD...`, which runs CMD under a time limit between
# timestamped markers and its exit status.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
fi
export PYTHONPATH=/tmp/site:$PWD
# the device's copy of the tree can carry a stale .git: the JSON records take the commit from K3_GIT_SHA, which the
# `run` command has to pass in literally (K3_GIT_SHA=<sha> bash benchmarks/sessions/...; session 25 forgot it)
[ -n "${K3_GIT_SHA:-}" ] || echo "=== warning: K3_GIT_SHA is not set; the JSON records may name a stale commit"
step() { local limit=$1; shift; echo "=== [$(date +%T)] $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
