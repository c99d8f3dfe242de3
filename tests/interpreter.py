"""Re-running a test module under the Triton interpreter on CPU: TRITON_INTERPRET must be set before triton is
imported, so a module whose kernel tests need it runs itself again in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
# every case in the interpreter too (`K3_INTERPRETER_ALL=1 make test`): see `cases`
INTERPRETER_ALL = os.environ.get("K3_INTERPRETER_ALL", "0") == "1"
ROOT = Path(__file__).resolve().parents[1]


def run_module_in_interpreter(path: str) -> None:
    """`pytest -x` on the module at `path` with TRITON_INTERPRET=1; fails with the tail of its output."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # 30 min: the KDA file took 880-900+ s beside the other pytest worker on an AVX2-only 2-core AMD EPYC (session 18;
    # ~300 s on earlier sessions' Xeons); CI's limit is 90 min for the whole suite
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]


def cases(*values, gpu_only=()):
    """Parametrize values, where those in `gpu_only` repeat a path that the other values already take through the
    kernels (another dtype, length or slice count): they run on a GPU always and in the interpreter only with
    K3_INTERPRETER_ALL=1, which keeps the CPU suite within its time (each costs 10-35 s of interpreted Python on
    a 2-core machine). A tuple value gives one argument per name."""
    mark = pytest.mark.skipif(INTERPRETING and not INTERPRETER_ALL,
                              reason="a repeated path: on a GPU, or in the interpreter with K3_INTERPRETER_ALL=1")
    return [(pytest.param(*v, marks=mark) if isinstance(v, tuple) else pytest.param(v, marks=mark))
            if v in gpu_only else v for v in values]
