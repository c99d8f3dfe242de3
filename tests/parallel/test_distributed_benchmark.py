"""benchmarks/distributed.py end to end on gloo: jobs run, the 2-rank losses follow the 1-rank run, the byte
counter meets the algorithms' prediction, and --report re-renders merged JSON files."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_distributed_benchmark_smoke(tmp_path):
    out = tmp_path / "dist.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "distributed.py"), "--device", "cpu", "--preset", "debug",
           "--worlds", "1", "2", "--configs", "fsdp", "fsdp+cp", "--steps", "3", "--rows", "2", "--seq-len", "64",
           "--activation-checkpointing", "--threads", "2", "--job-timeout", "240", "--json", str(out),
           "--concurrent-references", "--repeat-reference", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    results = json.loads(out.read_text())
    assert [(r["world"], r["config"], r.get("repeat")) for r in results] == [
        (1, "fsdp", None), (2, "fsdp", None), (2, "fsdp+cp", None), (1, "fsdp", True)]
    repeat = results.pop()  # the first 2 steps of the same 3-step schedule: the same losses on a CPU
    assert repeat["losses"] == results[0]["losses"][:2]
    for r in results[1:]:
        assert max(abs(a - b) for a, b in zip(r["losses"], results[0]["losses"])) < 1e-4
        for kind in ("fsdp_all_gather", "fsdp_reduce_scatter", "all_reduce"):
            assert abs(r["bytes"][kind] / r["prediction"][kind] - 1) < 0.01, kind
    cp = results[2]  # recomputed forwards count their collectives again, their backward once
    assert abs(cp["bytes"]["cp_all_gather"] / cp["prediction"]["cp_all_gather"] - 1) < 1e-6
    report = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "distributed.py"), "--report", str(out)],
                            check=True, capture_output=True, text=True, timeout=120)
    assert "fsdp+cp" in report.stdout and "bytes received" in report.stdout and "fsdp (repeat)" in report.stdout
