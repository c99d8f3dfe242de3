"""The training loop end to end on the debug preset: learning, exact resume after SIGKILL, crash-safe
checkpoints, non-finite steps, and the errors a user can run into."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from k3.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from k3.train.config import ContextStage, TrainConfig
from k3.train.loop import TrainingError, train

REPO = Path(__file__).resolve().parents[2]


def write_corpus(folder: Path, n_files: int = 24) -> Path:
    """A small deterministic Python-like corpus (no download)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        lines = [f"def function_{i}_{j}(x, y={j}):\n    return x * {i} + y - {j}\n" for j in range(30)]
        (folder / f"module_{i}.py").write_text(f'"""Module {i}."""\n\nimport math\n\n' + "\n".join(lines))
    return folder


def small_config(tmp_path: Path, **changes) -> TrainConfig:
    cfg = TrainConfig(preset="debug", data=str(write_corpus(tmp_path / "corpus")), out=str(tmp_path / "run"),
                      tokens_per_step=256, stages=[ContextStage(32, 0.5), ContextStage(64, 0.5)], max_steps=8,
                      eval_every=4, eval_tokens=512, checkpoint_every=4, vocab_size=600, heldout_fraction=0.1,
                      lr=1e-2)
    for k, v in changes.items():
        setattr(cfg, k, v)
    return cfg


def read_metrics(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_training_learns_and_writes_a_complete_run(tmp_path):
    cfg = small_config(tmp_path, max_steps=16)
    summary = train(cfg, log=lambda *_: None, progress=False)
    run = Path(cfg.out)
    train_records = read_metrics(run, "train")
    assert [r["step"] for r in train_records] == list(range(1, 17))
    assert train_records[-1]["loss"] < train_records[0]["loss"] - 1.0
    assert summary.final_eval_loss < summary.unigram_entropy
    assert {r["seq_len"] for r in train_records} == {32, 64}  # both context stages ran
    assert all(len(r["moe_max_over_mean"]) == 4 for r in train_records)
    for name in ("loss.png", "optim.png", "moe_balance.png"):
        assert (run / "plots" / name).stat().st_size > 1000
    for name in ("run.json", "config.json", "git.diff", "tokenizer/tokenizer.json"):
        assert (run / name).exists()
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt.name == "step_00000016"
    tensors, state = load_checkpoint(ckpt)
    assert state["step"] == 16 and "optimizer" in state and "data" in state
    # Quantile Balancing moved the router biases away from zero
    biases = [v for k, v in tensors.items() if k.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)


def _train_cmd(cfg: TrainConfig, resume: bool) -> list[str]:
    code = (f"import json, sys; from k3.train.config import TrainConfig; from k3.train.loop import train; "
            f"cfg = TrainConfig.from_dict(json.loads(sys.argv[1])); train(cfg, resume={resume}, progress=False)")
    return [sys.executable, "-c", code, json.dumps(cfg.as_dict())]


def test_resume_after_sigkill_equals_an_uninterrupted_run(tmp_path):
    # both runs in fresh processes with the same thread count, so CPU reductions round identically
    env = dict(os.environ, OMP_NUM_THREADS="1")
    straight = small_config(tmp_path / "a", max_steps=12, checkpoint_every=4, eval_every=6)
    subprocess.run(_train_cmd(straight, False), cwd=REPO, env=env, check=True)
    expected = read_metrics(Path(straight.out), "train")

    killed = small_config(tmp_path / "b", max_steps=12, checkpoint_every=4, eval_every=6)
    run = Path(killed.out)
    proc = subprocess.Popen(_train_cmd(killed, False), cwd=REPO, env=env)
    # kill hard once the step-4 checkpoint exists and at least one more step was logged
    deadline = time.time() + 300
    while time.time() < deadline:
        done = (run / "metrics.jsonl").exists() and any(r["step"] >= 6 for r in read_metrics(run, "train"))
        if latest_checkpoint(run / "checkpoints") is not None and done:
            break
        if proc.poll() is not None:
            pytest.fail("the training process ended before it could be killed")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert latest_checkpoint(run / "checkpoints") is not None
    subprocess.run(_train_cmd(killed, True), cwd=REPO, env=env, check=True)
    resumed = read_metrics(run, "train")
    assert [r["step"] for r in resumed] == list(range(1, 13))
    for a, b in zip(expected, resumed):
        assert a["loss"] == b["loss"], a["step"]
        assert a["grad_norm"] == b["grad_norm"], a["step"]
        assert a["moe_max_over_mean"] == b["moe_max_over_mean"], a["step"]


def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path, monkeypatch):
    cfg = small_config(tmp_path, max_steps=12, max_bad_steps=3, checkpoint_every=2)
    import k3.model.model as model_module

    real_loss = model_module.linear_cross_entropy
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        out = real_loss(*args, **kwargs)
        calls["n"] += 1
        # training steps 5, 6, 7 ... produce NaN (evaluation calls pass through untouched)
        if torch.is_grad_enabled() and calls["n"] >= 5:
            return out * float("nan")
        return out

    monkeypatch.setattr(model_module, "linear_cross_entropy", poisoned)
    with pytest.raises(TrainingError, match="3 non-finite steps in a row"):
        train(cfg, log=lambda *_: None, progress=False)
    records = read_metrics(Path(cfg.out), "train")
    assert [r.get("skipped", False) for r in records][-3:] == [True, True, True]
    ckpt = latest_checkpoint(Path(cfg.out) / "checkpoints")
    tensors, state = load_checkpoint(ckpt)  # the last good checkpoint is usable
    assert all(torch.isfinite(t).all() for t in tensors.values())
    first_bad = next(r["step"] for r in records if r.get("skipped"))
    assert first_bad > 1 and state["step"] <= records[-1]["step"]


def test_partial_and_corrupted_checkpoints(tmp_path):
    root = tmp_path / "ckpts"
    good = save_checkpoint(root, 1, {"w": torch.ones(3)}, {"step": 1})
    # a crash mid-write leaves a .tmp directory without COMMITTED: ignored
    (root / "step_00000002.tmp").mkdir()
    (root / "step_00000002.tmp" / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(root) == good
    # a committed directory missing its marker is refused with a clear message
    second = save_checkpoint(root, 2, {"w": torch.full((3,), 2.0)}, {"step": 2})
    (second / "COMMITTED").unlink()
    assert latest_checkpoint(root) == good
    with pytest.raises(CheckpointError, match="partial checkpoint"):
        load_checkpoint(second)
    # a flipped byte is detected by the manifest
    third = save_checkpoint(root, 3, {"w": torch.full((3,), 3.0)}, {"step": 3})
    data = bytearray((third / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (third / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(third)
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        save_checkpoint(root, 3, {"w": torch.zeros(3)}, {"step": 3})


def test_bad_input_is_refused_with_clear_errors(tmp_path):
    log = lambda *_: None  # noqa: E731
    with pytest.raises(ValueError, match="unknown preset"):
        train(small_config(tmp_path / "p", preset="enormous"), log=log, progress=False)
    with pytest.raises(ValueError, match="does not exist"):
        train(small_config(tmp_path / "m", data=str(tmp_path / "missing")), log=log, progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError):
        train(small_config(tmp_path / "e", data=str(empty)), log=log, progress=False)
    with pytest.raises(ValueError, match="fewer than one batch"):
        train(small_config(tmp_path / "s", tokens_per_step=2**20, stages=[ContextStage(1024, 1.0)]),
              log=log, progress=False)
    with pytest.raises(ValueError, match="optimizer_impl"):
        train(small_config(tmp_path / "o", optimizer_impl="foreach"), log=log, progress=False)
    # an output folder that holds something else, or another run
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a k3 training run"):
        train(small_config(tmp_path / "o", out=str(other)), log=log, progress=False)
    cfg = small_config(tmp_path / "r", max_steps=2, checkpoint_every=2, eval_every=2)
    train(cfg, log=log, progress=False)
    with pytest.raises(ValueError, match="already holds a training run"):
        train(cfg, log=log, progress=False)
    changed = small_config(tmp_path / "r", max_steps=2, lr=0.5)
    with pytest.raises(ValueError, match="different settings"):
        train(changed, resume=True, log=log, progress=False)
    assert (other / "notes.txt").read_text() == "mine"


def test_cli_train_and_generate(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "k3.cli", "train", "--preset", "debug", "--data", str(corpus), "--out", str(out),
           "--max-steps", "3", "--seq-len", "32", "--tokens-per-step", "128", "--vocab-size", "600",
           "--eval-every", "3", "--checkpoint-every", "3"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "held-out loss" in result.stdout
    gen = subprocess.run([sys.executable, "-m", "k3.cli", "generate", str(out), "--prompt", "def ",
                          "--max-new-tokens", "8"], cwd=REPO, capture_output=True, text=True)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("def ")
    bad = subprocess.run(cmd + ["--preset", "nonsense", "--out", str(tmp_path / "other")], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown preset" in bad.stderr


def test_train_step_reads_the_device_once_and_not_after_the_update(monkeypatch):
    """train_step reads its numbers back (loss, gradient norm, expert loads, QB token counts, QK-Clip's) before
    the optimizer step; after the update nothing waits for the device, so on a GPU the next step's launches
    overlap the optimizer's kernels. Reads are caught through the Tensor methods that copy a value to the host
    (the CPU reference paths of the forward read too; on a GPU the fast paths do not: tests/model/test_host_sync.py)."""
    from k3.config import get_preset
    from k3.model.model import build_model
    from k3.optim import MuonAdamW, cosine_schedule
    from k3.train.data import Batch
    from k3.train.loop import train_step

    model = build_model(get_preset("debug"), seed=0)
    optimizer = MuonAdamW(model.named_parameters(), model.config, lr=0.01, ns_dtype=torch.float32)
    phase, reads = ["before"], []
    optimizer.register_step_post_hook(lambda *_: phase.append("after"))
    scheduler = cosine_schedule(optimizer, 10)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=g)
    batch = Batch(ids, torch.roll(ids, -1, dims=1), torch.tensor([0, 20, 64, 128]), 128)
    cfg = TrainConfig(preset="debug", qk_clip_tau=1e-3)  # QK-Clip rescales heads at init's small logits
    for name in ("tolist", "item", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k:
                            (reads.append((phase[-1], _n)), _o(self, *a, **k))[1])
    metrics = train_step(model, optimizer, scheduler, [batch], cfg, torch.device("cpu"))
    monkeypatch.undo()
    assert phase[-1] == "after" and metrics["qk_clip_heads"] > 0, metrics
    assert [r for r in reads if r[0] == "after"] == [], reads
    assert len(metrics["moe_max_over_mean"]) == len(metrics["moe_max_vio"]) > 0
