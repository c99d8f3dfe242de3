"""Run the Triton kernels through the Triton interpreter on CPU (a subprocess: TRITON_INTERPRET must be
set before triton is imported). The checks and their tolerances are in triton_interpreter_checks.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "tests.ops.triton_interpreter_checks"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
