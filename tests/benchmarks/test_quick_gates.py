"""The new benchmarks' correctness gates at tiny shapes (`--quick`), so the scripts cannot rot between GPU
sessions. Subprocesses: each benchmark switches on the Triton interpreter before importing Triton."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["benchmarks.short_conv", "benchmarks.cross_entropy"])
def test_quick_gate_passes(module):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the quick gate runs on CPU even on a GPU machine
    run = subprocess.run([sys.executable, "-m", module, "--quick"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FAIL" not in run.stdout
