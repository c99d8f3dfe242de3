"""Re-running a test module under the Triton interpreter on CPU: TRITON_INTERPRET must be set before triton is
imported, so a module whose kernel tests need it runs itself again in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
ROOT = Path(__file__).resolve().parents[1]


def run_module_in_interpreter(path: str) -> None:
    """`pytest -x` on the module at `path` with TRITON_INTERPRET=1; fails with the tail of its output."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # 30 min: the KDA file took 880-900+ s beside the other pytest worker on an AVX2-only 2-core AMD EPYC (session 18;
    # ~300 s on earlier sessions' Xeons); CI's limit is 90 min for the whole suite
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]
