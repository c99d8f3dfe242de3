"""benchmarks/kda.py's results tables, built from recorded measurements without a GPU: the records kept in
benchmarks/results/kda-h200.json give back that file's "cases", "targets" and "accuracy" tables, and a --compare
record gives "compare" and "kernels" tables that benchmarks/report.py reads. A subprocess: importing the script
switches on the Triton interpreter where no GPU is present."""

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

COMPARE = [{"shape": {"B": 1, "T": 8192, "H": 96}, "tuning": {}, "gate_ok": True, "gate": {"o": 3e-3},
            "fwd_ms": 1.3, "fwd_bwd_ms": 9.6,
            "kernels_ms": {"_bwd_k_block": 2.45, "_state_bwd": 1.21, "_prep_gate": 0.25,
                           "void at::native::vectorized_elementwise_kernel<4>(int, ...)": 0.02},
            "fwd_kernels_ms": {"_prefill_prepare": 1.208, "_prefill_state": 0.726}},
           {"shape": {"B": 1, "T": 8192, "H": 96}, "tuning": {"bwd_k_rows": 32}, "gate_ok": False,
            "gate": {"refused": "out of resources"}}]

BUILD = """
import json, sys
from benchmarks import kda
from benchmarks.provenance import save_result
raw = json.load(open("benchmarks/results/kda-h200.json"))["raw"]
compare = json.loads(sys.argv[1])
headline = kda.result_tables(raw["cases"]["records"], raw["accuracy"]["records"], None, fla_configs=1,
                             fla_version="0.6.0")
compared = kda.result_tables([], None, compare)
save_result("kda", kda.CLAIM, compared, out=sys.argv[2], slug="test", commit="abc1234", device="test")
print(json.dumps({"headline": headline, "compared": compared}))
"""


def test_tables_from_recorded_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-c", BUILD, json.dumps(COMPARE), str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    built = json.loads(run.stdout.splitlines()[-1])
    recorded = json.loads((ROOT / "benchmarks" / "results" / "kda-h200.json").read_text())["tables"]
    for name in ("cases", "targets", "accuracy"):
        assert built["headline"][name]["columns"] == recorded[name]["columns"], name
        assert built["headline"][name]["rows"] == recorded[name]["rows"], name
    assert built["headline"]["cases"]["note"] == recorded["cases"]["note"]

    tables = built["compared"]
    assert set(tables) == {"compare", "kernels"}
    assert tables["compare"]["rows"] == [["B=1 T=8192 H=96", "{}", "ok", 1.3, 9.6],
                                         ["B=1 T=8192 H=96", '{"bwd_k_rows": 32}', "refused", None, None]]
    assert tables["kernels"]["rows"] == [
        ["`_prep_gate`", "prepare", 0.25], ["`_state_bwd`", "backward: state pass", 1.21],
        ["`_bwd_k_block`", "backward: scores", 2.45], ["other kernels (PyTorch)", "other", 0.02],
        ["`_prefill_prepare`", "inference forward: prepare (all segments)", 1.208],
        ["`_prefill_state`", "inference forward: state pass (all segments)", 0.726]]
    (path,) = tmp_path.glob("kda-test.json")
    assert file_problems(path.name, json.loads(path.read_text())) == []
