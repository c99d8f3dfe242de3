"""The report card from small realistic stage outputs: records in the formats `k3 train`, `k3 sft`, `k3 rl`,
`k3 mopd`, `k3 train-draft`, `k3 eval` and the serve step write (shapes taken from real runs at the debug preset)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from k3.recipe.recipe import load_recipe
from k3.recipe.report import (
    build,
    headline_markdown,
    serve_commands,
    tokens_per_verify,
    update_readme,
    write_report,
)

# a 1×1 PNG
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJ"
                       "RU5ErkJggg==")


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _png(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(PNG)


def _checkpoint(folder: Path, qat: str = "none") -> None:
    ckpt = folder / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "COMMITTED").write_text("2")
    text = {"hidden_size": 64, **({"qat": qat, "qat_scale_mode": "rceil"} if qat != "none" else {})}
    (ckpt / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": text}))
    (folder / "run.json").write_text("{}")


def _efforts(accuracy: float, tokens: float, efforts=("high",)) -> dict:
    return {e: {"n": 4, "reward": 2 * accuracy - 1, "accuracy": accuracy, "over_budget": 0.25, "truncated": 0.0,
                "tokens": tokens, "budget_tokens": 24.0, "tau": 1.0} for e in efforts}


def _eval(folder: Path, mc: float, nats: float, extra: dict | None = None, files: list[str] = ()) -> None:
    tasks = {"k3_python_mc": {"sample_len": 6.0, "acc": mc, "acc_stderr": 0.2, "acc_norm": mc},
             "k3_python_cloze": {"sample_len": 6.0, "perplexity": 5e11, "acc": 0.0},
             "perplexity": {"nats_per_token": nats, "bits_per_byte": nats / 2, "perplexity": 2.718 ** nats},
             "k3_arithmetic": {"sample_len": 6.0, "exact_match": 0.0}, **(extra or {})}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps({"model": "m", "tasks": tasks, "n": {t: 6 for t in tasks},
                                                     "files": list(files), "details": {}, "seconds": {}}))


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A finished debug-recipe folder with each stage's outputs in its command's format."""
    out = tmp_path / "run"
    recipe = load_recipe("debug")
    state = {"recipe": "debug", "text": recipe.text, "status": "done",
             "environment": {"k3_revision": "abc1234", "python": "3.11.7", "torch": "2.13.0+cpu", "cpu": "Xeon",
                             "cpus": 2, "platform": "Linux"},
             "stages": {s.name: {"status": "done", "seconds": 12.5, "exit_code": 0, "attempts": 1}
                        for s in recipe.stages}}
    out.mkdir()
    (out / "recipe.json").write_text(json.dumps(state))
    pre = out / "pretrain"
    _jsonl(pre / "metrics.jsonl", [
        {"kind": "event", "step": 0, "event": "start", "unigram_entropy": 3.24, "train_tokens": 11775134,
         "params": 1927622},
        {"kind": "train", "step": 12, "tokens_seen": 24485, "loss": 2.925, "lr": 6e-4},
        {"kind": "eval", "step": 12, "loss": 2.953, "perplexity": 19.2, "tokens": 34679}])
    _png(pre / "plots" / "loss.png")
    _checkpoint(pre)
    _jsonl(out / "sft-data" / "sft.jsonl", [{"id": i, "reasoning_effort": e, "messages": []}
                                          for i in range(2) for e in ("low", "high", "max")])
    sft = out / "sft"
    _jsonl(sft / "metrics.jsonl", [
        {"kind": "event", "step": 0, "event": "start", "train_documents": 137, "skipped_documents": 38},
        {"kind": "eval", "step": 0, "loss": 4.297}, {"kind": "train", "step": 4, "loss": 3.554},
        {"kind": "eval", "step": 4, "loss": 3.497}])
    _checkpoint(sft)
    for effort, acc in (("low", 0.25), ("high", 0.5), ("max", 0.75)):
        rl = out / f"rl-{effort}"
        _jsonl(rl / "metrics.jsonl", [
            {"kind": "rl_eval", "step": 0, "efforts": _efforts(0.0, 24.0, (effort,))},
            {"kind": "rl", "step": 1, "groups": 2, "trained_groups": 1, "efforts": _efforts(0.0, 24.0, (effort,))},
            {"kind": "rl", "step": 2, "groups": 2, "trained_groups": 2, "efforts": _efforts(acc, 20.0, (effort,))},
            {"kind": "rl_eval", "step": 2, "efforts": _efforts(acc, 18.0, (effort,))}])
        _png(rl / "plots" / "rl_rollouts.png")
        _checkpoint(rl)
    _checkpoint(out / "qat", qat="mxfp4")
    mopd = out / "mopd"
    _checkpoint(mopd, qat="mxfp4")
    (mopd / "run.json").write_text(json.dumps({"mopd_config": {"r_max": 5.0, "teachers": [
        {"domain": "math", "effort": e, "run": str(out / f"rl-{e}" / "checkpoints" / "step_00000002")}
        for e in ("low", "high", "max")]}}))
    teachers = {f"math:{e}": {"teacher_kl": 0.1, "advantage": -0.1} for e in ("low", "high", "max")}
    _jsonl(mopd / "metrics.jsonl", [
        {"kind": "rl_eval", "step": 0, "efforts": _efforts(0.0, 24.0, ("low", "high", "max"))},
        {"kind": "rl", "step": 1, "teachers": teachers, "efforts": {}},
        {"kind": "rl", "step": 2, "teachers": {k: {"teacher_kl": 0.01} for k in teachers}, "efforts": {}},
        {"kind": "rl_eval", "step": 2, "efforts": _efforts(0.5, 16.0, ("low", "high", "max"))}])
    _png(mopd / "plots" / "mopd.png")
    _checkpoint(out / "export")
    _checkpoint(out / "export-bf16")
    draft = out / "draft"
    _jsonl(draft / "metrics.jsonl", [
        {"kind": "event", "step": 0, "event": "start", "total_steps": 4},
        {"kind": "eval", "step": 0, "loss": 1.82, "acceptance": [0.16] * 7, "tokens_per_verify": 1.19},
        {"kind": "eval", "step": 4, "loss": 1.5, "acceptance": [0.25] * 7, "tokens_per_verify": 1.33}])
    _png(draft / "plots" / "acceptance.png")
    _checkpoint(draft)
    _png(out / "eval" / "passkey.png")
    _eval(out / "eval", 0.5, 2.5, {"passkey": {"accuracy": 0.2, "accuracy@1024": 0.2}},
          files=[str(out / "eval" / "passkey.png")])
    _eval(out / "eval" / "humaneval", 0, 0, None)
    (out / "eval" / "humaneval" / "results.json").write_text(json.dumps({
        "tasks": {"humaneval": {"pass@1": 0.0}}, "n": {"humaneval": 2}, "files": [],
        "details": {"humaneval": {"problems": 2, "samples_per_problem": 1, "executor": "sandbox"}}}))
    for stage, mc, nats in (("eval-pretrain", 0.25, 2.25), ("eval-sft", 0.375, 2.75), ("eval-rl-high", 0.375, 2.875),
                            ("eval-export", 0.5, 2.5625), ("eval-export-bf16", 0.25, 3.5)):
        _eval(out / stage, mc, nats)
    (out / "serve").mkdir()
    (out / "serve" / "serve.json").write_text(json.dumps({
        "command": f"k3 serve --checkpoint {mopd}", "requests": 4, "max_tokens": 16, "completion_tokens": 64,
        "seconds": 2.0, "tokens_per_s": 32.0, "single_request_tokens_per_s": 12.0, "mean_request_s": 1.5}))
    (out / "serve" / "serve-draft.json").write_text(json.dumps({
        "command": f"k3 serve --checkpoint {mopd} --draft {draft}", "requests": 4, "max_tokens": 16,
        "completion_tokens": 64, "seconds": 1.6, "tokens_per_s": 40.0, "single_request_tokens_per_s": 18.0,
        "mean_request_s": 1.2, "accepted_prediction_tokens": 30, "rejected_prediction_tokens": 10}))
    return out


def test_report_has_every_section(run_dir):
    md, page = write_report(run_dir)
    text = md.read_text()
    for heading in ("## Stages", "## pretrain", "## sft-data", "## sft", "## rl-low", "## rl-high", "## rl-max",
                    "## qat", "## mopd", "## export", "## export-bf16", "## draft", "## eval", "## serve",
                    "## QAT vs bf16 export gap", "## The model after each stage"):
        assert heading in text, heading
    assert "abc1234" in text and "2.13.0+cpu" in text
    assert "| 2.953 | 3.24 |" in text  # held-out loss next to the unigram entropy
    assert "4.297 → 3.497" in text
    assert "| high | -1 → 0 | 0.0% → 50.0% | 25.0% → 25.0% | 24 → 18 | 4 |" in text
    # the student against each teacher, the teacher's accuracy read from its own RL stage
    assert re.search(r"\| math:max \| rl-max \| 0\.0% \| 50\.0% \| 75\.0% \|", text)
    assert "| math:low | 0.1 | 0.01 |" in text
    # the QAT student's export gap (2.5 → 2.5625 nats/token) and the bf16-trained model's (2.875 → 3.5)
    assert "| mopd | with QAT (mxfp4) | perplexity nats_per_token | 2.5 | 2.5625 | 0.0625 |" in text
    assert "| rl-high | without QAT | perplexity nats_per_token | 2.875 | 3.5 | 0.625 |" in text
    assert "k3_python_cloze perplexity" not in text.split("## The model after each stage")[1]
    assert "| 7 | 0.16 | 0.25 |" in text and "HumanEval: 2 problems" in text
    assert "| 4 | 64 | 2 | 32 | 12 | — |" in text and "| 4 | 64 | 1.6 | 40 | 18 | 75.0% |" in text
    assert "1.50× the tokens/s of one request, 1.25× over the batch" in text
    assert serve_commands(run_dir) == [f"k3 serve --checkpoint {run_dir / 'mopd'}",
                                       f"k3 serve --checkpoint {run_dir / 'mopd'} --draft {run_dir / 'draft'}"]
    rows = re.findall(r"^\| ([a-z0-9-]+) \| eval", text.split("## The model after each stage")[1], re.M)
    assert rows == ["pretrain", "sft", "rl-high", "mopd", "export", "export-bf16"]  # the order the recipe made them
    assert (run_dir / "report" / "comparison.png").is_file() and (run_dir / "report" / "rl_efforts.png").is_file()
    assert "![held-out scores of the model after each stage](report/comparison.png)" in text
    html = page.read_text()
    images = re.findall(r"<img src='([^']*)'", html)
    assert len(images) == text.count("![") and all(src.startswith("data:image/png;base64,") for src in images)
    assert "href=" not in html and "src='http" not in html and "src='/" not in html


def test_report_of_a_partial_run_and_the_readme_block(run_dir, tmp_path):
    state = json.loads((run_dir / "recipe.json").read_text())
    state["status"] = "failed"
    state["stages"]["draft"] = {"status": "failed", "exit_code": 2, "seconds": 3.0,
                                "message": "k3 train-draft: error: x"}
    for name in ("eval", "serve"):
        state["stages"].pop(name)
    (run_dir / "recipe.json").write_text(json.dumps(state))
    md, _ = write_report(run_dir)
    text = md.read_text()
    assert "k3 train-draft: error: x" in text and "| 18 | serve | serve | not run |" in text
    readme = tmp_path / "README.md"
    readme.write_text("# k3\n\n<!-- recipe: debug -->\nnot yet run\n<!-- /recipe -->\n\nmore\n")
    update_readme(run_dir, readme)
    new = readme.read_text()
    assert "not yet run" not in new and new.endswith("<!-- /recipe -->\n\nmore\n")
    assert "| pre-training: held-out loss vs unigram entropy (nats/token) | 2.953 vs 3.240 |" in new
    assert headline_markdown(run_dir) in new
    readme.write_text("no block\n")
    with pytest.raises(ValueError, match="no <!-- recipe: debug -->"):
        update_readme(run_dir, readme)


def test_tokens_per_verify_formula():
    # one rate α: (1 − α^{k+1}) / (1 − α), docs/speculative.md
    for a in (0.2, 0.76):
        for k in (1, 4, 7):
            assert tokens_per_verify([a] * 7, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    assert tokens_per_verify([0.5, 0.5], 0) == 1.0


def test_report_refuses_a_folder_without_a_run(tmp_path):
    with pytest.raises(ValueError, match="holds no recipe run"):
        build(tmp_path)
