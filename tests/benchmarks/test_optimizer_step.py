"""benchmarks/optimizer_step.py --quick on CPU (the Triton kernels in the interpreter): the correctness gate
passes and the report is written, so the script cannot rot between GPU sessions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_optimizer_step_quick(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the quick gate runs on CPU even on a GPU machine
    run = subprocess.run([sys.executable, "-m", "benchmarks.optimizer_step", "--quick", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok   gate" in run.stdout and "FAIL" not in run.stdout
    (report,) = tmp_path.glob("optimizer_step-debug-*.json")
    results = json.loads(report.read_text())["results"]
    assert set(results) == {"reference", "fused"} and all(r["ms"] > 0 for r in results.values())
