"""benchmarks/optimizer_step.py --quick on CPU (the Triton kernels in the interpreter): the correctness gate
passes and the results file is written in the format benchmarks/report.py reads, so the script cannot rot
while no GPU runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.report import file_problems  # noqa: E402


def test_optimizer_step_quick(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the quick gate runs on CPU even on a GPU machine
    run = subprocess.run([sys.executable, "-m", "benchmarks.optimizer_step", "--quick", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok   gate" in run.stdout and "FAIL" not in run.stdout
    (path,) = tmp_path.glob("optimizer-step-*.json")
    record = json.loads(path.read_text())
    assert file_problems(path.name, record) == []
    assert record["command"].startswith("python -m benchmarks.optimizer_step --quick")
    rows = record["tables"]["step"]["rows"]
    assert [r[0] for r in rows] == ["reference (foreach)", "fused"] and all(r[1] > 0 for r in rows)
