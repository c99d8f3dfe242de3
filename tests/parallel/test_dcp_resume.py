"""Distributed checkpoints: a run saved by 4 processes resumes on 2 and continues as if uninterrupted."""

import json
import os
import shutil

import pytest

from k3.checkpoint import committed_checkpoints, verify_checkpoint
from k3.train.config import ContextStage, TrainConfig
from k3.train.loop import train
from tests.parallel.spawn import run_workers


def _corpus(folder):
    import inspect
    import textwrap

    folder.mkdir()
    for module in (json, os, shutil, inspect, textwrap):
        (folder / f"{module.__name__}.txt").write_text(inspect.getsource(module))


def _worker(rank, world, data, out, resume, cp):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    cfg = TrainConfig(preset="debug", data=data, out=out, max_steps=4, tokens_per_step=1024,
                      stages=[ContextStage(128, 1.0)], eval_every=2, checkpoint_every=2, eval_tokens=1024,
                      muon_ns_dtype="float32", device="cpu", context_parallel=cp, vocab_size=512)
    summary = train(cfg, resume=resume, progress=False)
    return summary.steps


def _train_losses(run):
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"}


def test_save_on_four_resume_on_two(tmp_path):
    data = tmp_path / "data"
    _corpus(data)
    full = tmp_path / "full"
    assert run_workers(_worker, 4, str(data), str(full), False, 2) == [4] * 4
    ckpts = committed_checkpoints(full / "checkpoints")
    assert [c.name for c in ckpts] == ["step_00000002", "step_00000004"]
    verify_checkpoint(ckpts[0])
    assert (ckpts[0] / ".metadata").exists()  # DCP

    # the same run interrupted after step 2, resumed by 2 processes without context parallelism
    want = _train_losses(full)
    shutil.rmtree(full / "checkpoints" / "step_00000004")
    assert run_workers(_worker, 2, str(data), str(full), True, 1) == [4] * 2
    got = _train_losses(full)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-5)
