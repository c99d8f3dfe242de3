"""The harness for testing Triton kernels on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is imported, so a test module whose kernel tests need it runs itself
again in a subprocess with it set, and its kernel tests skip in the parent process. On a CUDA machine the kernel
tests run directly on the GPU. A module adopts the pattern with two lines:

    test_in_triton_interpreter = rerun_in_interpreter(__file__)

    @pytest.fixture
    def dev():
        return kernel_device()
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
# every case in the interpreter too (`K3_INTERPRETER_ALL=1 make test`): see `cases`
INTERPRETER_ALL = os.environ.get("K3_INTERPRETER_ALL", "0") == "1"
ROOT = Path(__file__).resolve().parents[1]


def run_module_in_interpreter(target: str) -> None:
    """`pytest -x` on `target` (a test file, or a file::test node id; a file that pytest would not collect by its
    name is collected too) with TRITON_INTERPRET=1; fails with the tail of its output."""
    # one thread unless told otherwise: interpreted kernels are single-threaded Python, and idle threads spinning
    # beside the other test worker's only slow both down
    env = {"OMP_NUM_THREADS": "1", **os.environ, "TRITON_INTERPRET": "1"}
    # 30 minutes: the KDA file is the slowest, ~15 on a 2-core machine beside another pytest worker
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(target)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]


def rerun_in_interpreter(target: str, on_gpu: bool = False):
    """A test that runs `target` in the interpreter (`run_module_in_interpreter`): skipped inside the interpreter
    and, unless `on_gpu`, on a CUDA machine, where the kernel tests run directly."""

    @pytest.mark.skipif(INTERPRETING or (ON_GPU and not on_gpu), reason="kernels run directly in this process")
    def test():
        pytest.importorskip("triton")
        run_module_in_interpreter(target)

    return test


def kernel_device() -> str:
    """Where this process runs kernels: "cuda" on a GPU, "cpu" inside the interpreter; otherwise the test skips
    (its module's interpreter run covers it)."""
    if not (ON_GPU or INTERPRETING):
        pytest.skip("runs in the Triton interpreter's subprocess")
    return "cuda" if ON_GPU else "cpu"


def cases(*values, gpu_only=()):
    """Parametrize values, where those in `gpu_only` repeat a path that the other values already take through the
    kernels (another dtype, length or slice count): they run on a GPU always and in the interpreter only with
    K3_INTERPRETER_ALL=1, which keeps the CPU suite within its time (each costs tens of seconds of interpreted
    Python on a 2-core machine). A tuple value gives one argument per name."""
    mark = pytest.mark.skipif(INTERPRETING and not INTERPRETER_ALL,
                              reason="a repeated path: on a GPU, or in the interpreter with K3_INTERPRETER_ALL=1")
    return [(pytest.param(*v, marks=mark) if isinstance(v, tuple) else pytest.param(v, marks=mark))
            if v in gpu_only else v for v in values]


def repeats(*values) -> tuple:
    """Values a test loops over that repeat a path its other values already take (as `cases`' gpu_only, for a
    loop inside one test): all of them on a GPU and with K3_INTERPRETER_ALL=1, none otherwise in the
    interpreter."""
    return () if INTERPRETING and not INTERPRETER_ALL else values
