"""The `debug` recipe end to end: every stage a real `k3` command at the debug preset, a report card with every
section, the serve commands printed. Several minutes on two CPU cores, so `slow`; tests/recipe/test_run.py covers
the orchestration (resume, failures) with cheap stages in the default suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from k3.recipe.recipe import load_recipe


@pytest.mark.slow
def test_debug_recipe_end_to_end(tmp_path):
    out = tmp_path / "debug"
    done = subprocess.run([sys.executable, "-m", "k3.cli", "recipe", "run", "debug", "--out", str(out)],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads((out / "recipe.json").read_text())
    recipe = load_recipe("debug")
    assert state["status"] == "done" and all(state["stages"][s.name]["status"] == "done" for s in recipe.stages)
    assert f"serve the model: k3 serve --checkpoint {out / 'mopd'}" in done.stdout
    text = (out / "report.md").read_text()
    for s in recipe.stages:
        if s.kind != "eval" or s.name == "eval":
            assert f"## {s.name}" in text, s.name
    for section in ("## Stages", "## QAT vs bf16 export gap", "## The model after each stage", "unigram entropy",
                    "held-out loss before → after", "| math:max | rl-max |", "KL(student ‖ teacher)",
                    "perplexity nats_per_token", "tokens per verify drafting k", "passkey", "humaneval | pass@1",
                    "tokens/s (batch)", "qat: mxfp4"):
        assert section in text, section
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == text.count("![") >= 10
