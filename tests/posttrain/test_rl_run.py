"""`k3 rl` end to end on the debug preset: metrics and plots, a stop and resume that equals an uninterrupted run
(paused trajectories travel through the checkpoint), refusals, and the command line."""

import json
import signal

import pytest
import torch

from k3.checkpoint import load_trained, save_checkpoint
from k3.cli import main
from k3.config import get_preset
from k3.model.model import build_model
from k3.posttrain.budget import TauCurriculum
from k3.posttrain.rl import RLConfig, rl
from k3.runfolder import StopSignals
from k3.train.metrics import MetricsLog


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def policy(tmp_path_factory, tokenizer):
    """A debug-preset run folder (the "SFT model"): its stop-token row scaled so replies end at varied lengths."""
    root = tmp_path_factory.mktemp("policy")
    tokenizer.save(root / "tokenizer")
    cfg = get_preset("debug").replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                      eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_id] *= 15
    save_checkpoint(root / "run" / "checkpoints", 1, model.state_dict(), {},
                    {"config.json": json.dumps(cfg.to_config_json())}, {"tokenizer": root / "tokenizer"})
    return root / "run"


def _cfg(policy, out, **kw):
    base = dict(init_from=str(policy), out=str(out), envs=["math"], num_tasks=12, heldout_tasks=2, iterations=4,
                prompts_per_iteration=3, samples_per_prompt=3, partial_fraction=0.5, max_tokens=16, b0_samples=2,
                eval_every=2, checkpoint_every=4, lr=3e-4, muon_ns_dtype="float32",
                curriculum=TauCurriculum(max_first_iterations=1, anneal_iterations=2, tau_cap=2.0,
                                         tau_final={"low": 0.5, "high": 1.0, "max": 2.0}))
    base.update(kw)
    return RLConfig(**base)


def _records(out, kind):
    return [r for r in MetricsLog(out / "metrics.jsonl").read() if r["kind"] == kind]


def test_rl_run_stop_and_resume_equals_uninterrupted(policy, tmp_path):
    whole = rl(_cfg(policy, tmp_path / "whole"), progress=False, log=lambda *a: None)
    assert whole.iterations == 4 and whole.stopped is None
    out = tmp_path / "whole"
    records = _records(out, "rl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert sum(r["paused"] for r in records) > 0  # partial rollouts carried trajectories across iterations
    assert sum(not r.get("skipped", False) for r in records) >= 2  # and the policy was updated
    assert set(records[0]["efforts"]) == {"max"} and set().union(*(r["efforts"] for r in records[1:])) > {"max"}
    for key in ("reward", "accuracy", "over_budget", "tokens", "tau"):
        assert key in records[-1]["efforts"][next(iter(records[-1]["efforts"]))]
    assert [r["step"] for r in _records(out, "rl_eval")] == [0, 2, 4]
    assert {p.name for p in (out / "plots").iterdir()} == {"rl_rollouts.png", "rl_heldout.png", "rl_optim.png"}
    assert all(t["b0"] > 0 for t in map(json.loads, (out / "tasks.jsonl").read_text().splitlines()))
    # the policy moved, and the result loads like any checkpoint
    trained, _, ckpt = load_trained(out)
    start, _, _ = load_trained(policy)
    assert ckpt.name == "step_00000004"
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), start.state_dict().values()))

    stop = StopSignals()
    stop.signum = signal.SIGINT  # as if Ctrl-C came during the first iteration
    first = rl(_cfg(policy, tmp_path / "parts"), progress=False, log=lambda *a: None, stop=stop)
    assert first.stopped == "SIGINT" and first.iterations == 1
    assert first.checkpoint.name == "step_00000001"
    state = torch.load(first.checkpoint / "train_state.pt", weights_only=True)
    assert state["rollouts"]["groups"]  # the trajectories in flight are in the checkpoint
    second = rl(_cfg(policy, tmp_path / "parts"), resume=True, progress=False, log=lambda *a: None)
    assert second.start_iteration == 1 and second.iterations == 4
    parts = _records(tmp_path / "parts", "rl")
    assert [r["step"] for r in parts] == [1, 2, 3, 4]
    for a, b in zip(records, parts):
        assert a["trajectories"] == b["trajectories"] and a["efforts"] == b["efforts"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-9, nan_ok=True)
    resumed, _, _ = load_trained(tmp_path / "parts")
    for (name, a), b in zip(trained.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name


def test_rl_refusals(policy, tmp_path):
    with pytest.raises(ValueError, match="unknown environment"):
        rl(_cfg(policy, tmp_path / "a", envs=["nope"]), progress=False)
    with pytest.raises(ValueError, match="samples_per_prompt"):
        rl(_cfg(policy, tmp_path / "a", samples_per_prompt=1), progress=False)
    with pytest.raises(ValueError, match="no RL run to resume"):
        rl(_cfg(policy, tmp_path / "a"), resume=True, progress=False)
    assert not (tmp_path / "a").exists()  # refusals come before anything is written
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a k3 RL run"):
        rl(_cfg(policy, tmp_path / "b"), progress=False)
    rl(_cfg(policy, tmp_path / "c", iterations=1, eval_every=5), progress=False, log=lambda *a: None)
    with pytest.raises(ValueError, match="already holds an RL run"):
        rl(_cfg(policy, tmp_path / "c", iterations=1), progress=False)
    with pytest.raises(ValueError, match="different settings"):
        rl(_cfg(policy, tmp_path / "c", iterations=2, max_tokens=8), resume=True, progress=False)


def test_cli(policy, tmp_path, capsys):
    assert main(["rl", "--from", str(policy), "--env", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown environment 'nope'" in capsys.readouterr().err
    assert main(["rl", "--env", "math", "--out", str(tmp_path / "x")]) == 2
    assert "--from is required" in capsys.readouterr().err
    code = main(["rl", "--from", str(policy), "--out", str(tmp_path / "y"), "--iterations", "1", "--prompts", "2",
                 "--samples", "2", "--max-tokens", "8", "--num-tasks", "4", "--heldout-tasks", "1",
                 "--efforts", "low,max", "--tau-final", "low=0.5,max=2", "--max-first", "0", "--device", "cpu"])
    assert code == 0
    assert "held-out low: accuracy" in capsys.readouterr().out
    # a resume needs only the folder: the run's own settings, a longer length on top
    assert main(["rl", "--out", str(tmp_path / "y"), "--resume", "--iterations", "2"]) == 0
    assert "2 iterations (resumed at iteration 1)" in capsys.readouterr().out
    assert main(["rl", "--out", str(tmp_path / "y"), "--resume", "--samples", "3"]) == 2
    assert "different settings (samples_per_prompt)" in capsys.readouterr().err
