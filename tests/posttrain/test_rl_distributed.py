"""RL on two gloo processes equals one process: the same rollouts (each process drives half of the groups on its own
engine), the same per-iteration metrics, and the same weights after the last update (FSDP2 + P2P Muon).

With λ = 1: with λ < 1 the point where a rollout pauses depends on engine timing, and a process's prefix cache holds
only its own groups' prompts, so prefills (and pauses) can fall on other steps than in one process
(docs/post-training.md)."""

import json
import os

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from k3.checkpoint import read_model, save_checkpoint
from k3.config import get_preset
from k3.model.model import build_model
from k3.posttrain.budget import TauCurriculum
from k3.posttrain.rl import RLConfig, rl
from k3.train.metrics import MetricsLog
from tests.parallel.spawn import run_workers


def _cfg(policy, out):
    return RLConfig(init_from=str(policy), out=str(out), envs=["math"], num_tasks=8, heldout_tasks=1, iterations=3,
                    prompts_per_iteration=4, samples_per_prompt=3, partial_fraction=1.0, max_tokens=12, b0_samples=2,
                    eval_every=10, checkpoint_every=10, lr=3e-4, muon_ns_dtype="float32", device="cpu",
                    curriculum=TauCurriculum(max_first_iterations=0, anneal_iterations=1))


def _worker(rank, world, policy, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    summary = rl(_cfg(policy, out), progress=False, log=lambda *a: None)
    return summary.iterations


@pytest.fixture
def policy(tmp_path, tokenizer):
    tokenizer.save(tmp_path / "tokenizer")
    cfg = get_preset("debug").replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                      eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_id] *= 15  # replies of varied lengths
    save_checkpoint(tmp_path / "policy" / "checkpoints", 1, model.state_dict(), {},
                    {"config.json": json.dumps(cfg.to_config_json())}, {"tokenizer": tmp_path / "tokenizer"})
    return tmp_path / "policy"


def test_two_processes_equal_one(policy, tmp_path, one_thread):
    rl(_cfg(policy, tmp_path / "one"), progress=False, log=lambda *a: None)
    assert run_workers(_worker, 2, str(policy), str(tmp_path / "two")) == [3, 3]
    one = MetricsLog(tmp_path / "one" / "metrics.jsonl").read()
    two = MetricsLog(tmp_path / "two" / "metrics.jsonl").read()
    assert [r["kind"] for r in one] == [r["kind"] for r in two]
    for a, b in zip(one, two):
        assert a["efforts"] == b["efforts"]  # the same rollouts: rewards, lengths, budgets, per effort
        if a["kind"] == "rl":
            assert (a["trajectories"], a["paused"], a["loss_tokens"]) == (b["trajectories"], b["paused"],
                                                                         b["loss_tokens"])
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-8, nan_ok=True)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, nan_ok=True)
    assert sum(not r.get("skipped", False) for r in one if r["kind"] == "rl") >= 2  # updates happened
    single = read_model(tmp_path / "one" / "checkpoints" / "step_00000003")
    dcp_to_torch_save(tmp_path / "two" / "checkpoints" / "step_00000003", tmp_path / "two.pt")
    sharded = torch.load(tmp_path / "two.pt", weights_only=False)["model"]
    assert set(single) == set(sharded)
    for name, t in single.items():
        assert torch.allclose(sharded[name], t, rtol=1e-4, atol=1e-6), name
