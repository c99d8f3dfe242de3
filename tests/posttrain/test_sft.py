"""`k3 sft` end to end on the debug preset: packing keeps conversations whole with their loss mask, an SFT run from
a tiny `k3 train` run learns and leaves a checkpoint every front end loads, bad data is refused as `k3 train`
refuses it, and a run killed mid-way resumes to exactly the uninterrupted run's metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from k3.checkpoint import latest_checkpoint, load_trained
from k3.cli import main
from k3.posttrain import sft_data
from k3.posttrain.conversations import write_conversations
from k3.posttrain.sft import Conversations
from k3.train.config import ContextStage, TrainConfig
from k3.train.data import IGNORE_INDEX, PackedBatches, TokenizedCorpus, prepare_corpus
from k3.train.loop import train
from tests.train.test_loop import write_corpus

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 512
SFT_ARGS = ["--seq-len", str(SEQ_LEN), "--tokens-per-step", "1024", "--lr", "3e-3"]


def read_metrics(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A tiny `k3 train` run of the debug preset (4 steps)."""
    root = tmp_path_factory.mktemp("base")
    cfg = TrainConfig(preset="debug", data=str(write_corpus(root / "corpus")), out=str(root / "run"),
                      tokens_per_step=256, stages=[ContextStage(64, 1.0)], max_steps=4, eval_every=4,
                      eval_tokens=256, checkpoint_every=4, vocab_size=600, heldout_fraction=0.1)
    train(cfg, log=lambda *_: None, progress=False)
    return Path(cfg.out)


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "sft.jsonl"
    write_conversations(sft_data.make_sft_dataset(40, seed=0), path)
    return path


def test_packing_keeps_conversations_whole_and_labels_only_the_mask(tmp_path, tokenizer, sft_file):
    source = Conversations(sft_file, tokenizer)
    docs = source.documents()
    encoded = source.encode(tokenizer, [text for _, text in docs])
    limit = sorted(len(ids) for ids, _ in encoded)[-10]  # the nine longest are left out, and counted
    corpus = prepare_corpus(docs, tokenizer, tmp_path / "c", show_progress=False, source=source,
                            max_document_tokens=limit)
    kept = [(ids, mask) for ids, mask in encoded if len(ids) <= limit]
    assert corpus.num_documents == len(kept) and len(corpus.meta["skipped"]) == len(encoded) - len(kept)
    assert corpus.whole_documents and TokenizedCorpus.open(corpus.directory).loss_mask is not None
    T = limit + 37
    by_tokens = {tuple(ids): mask for ids, mask in kept}
    seen = []
    for batches in (PackedBatches.eval(corpus, 3, T), PackedBatches(corpus, 3, T, seed=1, streams=4)):
        for n, batch in enumerate(batches):
            ids, labels = batch.input_ids.flatten(), batch.labels.flatten()
            cu = batch.cu_seqlens.tolist()
            for a, b in zip(cu, cu[1:]):
                segment = tuple(ids[a:b].tolist())
                if segment[0] == tokenizer.pad_id:  # the padding after the last conversation that fit
                    assert set(segment) == {tokenizer.pad_id} and (labels[a:b] == IGNORE_INDEX).all()
                    continue
                # a segment is exactly one whole conversation: starts with [BOS], nothing cut
                mask = by_tokens[segment]
                want = [segment[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(segment) - 1)]
                assert labels[a:b].tolist() == want + [IGNORE_INDEX]
                if not batches.loop:
                    seen.append(segment)
            assert set(range(0, 3 * T + 1, T)) <= set(cu)  # no segment crosses a row
            if batches.loop and n == 20:
                break
    # one evaluation pass sees every conversation once, in order
    assert seen == [tuple(ids) for ids, _ in kept]
    assert PackedBatches.eval(corpus, 1, T).rows_per_epoch() == len(list(PackedBatches.eval(corpus, 1, T)))
    with pytest.raises(ValueError, match="longest has"):
        PackedBatches(corpus, 2, limit - 1)


def test_sft_smoke_from_a_k3_train_run(tmp_path, base_run, sft_file, capsys):
    out = tmp_path / "sft"
    code = main(["sft", "--from", str(base_run), "--data", str(sft_file), "--out", str(out), "--max-steps", "8",
                 "--eval-every", "4", "--checkpoint-every", "4", *SFT_ARGS])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "trained 8 steps" in captured.out
    assert "skipped" in captured.out  # conversations longer than the 512-token context, counted
    evals = read_metrics(out, "eval")
    assert [r["step"] for r in evals] == [0, 4, 8]  # step 0: the base model on the held-out conversations
    assert evals[-1]["loss"] < evals[0]["loss"] - 0.5
    start = next(r for r in read_metrics(out, "event") if r["event"] == "start")
    assert start["skipped_documents"] > 0
    for name in ("loss.png", "optim.png"):
        assert (out / "plots" / name).stat().st_size > 1000
    # the checkpoint loads like any trained run's: same model and tokenizer as the base, new weights
    model, tokenizer, ckpt = load_trained(out)
    base_model, base_tokenizer, _ = load_trained(base_run)
    assert ckpt == latest_checkpoint(out / "checkpoints") and ckpt.name == "step_00000008"
    assert model.config == base_model.config and tokenizer.fingerprint() == base_tokenizer.fingerprint()
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), base_model.state_dict().values()))
    run_info = json.loads((out / "run.json").read_text())["train_config"]
    assert run_info["data_format"] == "conversations" and run_info["init_from"].endswith("step_00000004")
    # complete: a plain resume says so; k3 train refuses the folder (its data is conversations)
    assert main(["sft", "--out", str(out), "--resume"]) == 0
    assert "is complete" in capsys.readouterr().out
    assert main(["train", "--preset", "debug", "--out", str(out), "--resume"]) == 2
    assert "different settings" in capsys.readouterr().err


def test_bad_data_and_arguments_are_refused_before_anything_is_written(tmp_path, base_run, sft_file, capsys):
    bad = tmp_path / "bad.jsonl"
    lines = sft_file.read_text().splitlines()
    bad.write_text("\n".join(lines[:2] + ['{"messages": [{"role": "robot", "content": "x"}]}'] + lines[2:4]) + "\n")
    out = tmp_path / "sft"
    assert main(["sft", "--from", str(base_run), "--data", str(bad), "--out", str(out), "--max-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert f"k3 sft: error: {bad}:3: messages[0]: unknown role 'robot'" in err and "Traceback" not in err
    assert not out.exists()
    assert main(["sft", "--from", str(tmp_path / "nothing"), "--data", str(sft_file), "--out", str(out)]) == 2
    assert "k3 sft: error:" in capsys.readouterr().err and not out.exists()
    assert main(["sft", "--data", str(sft_file), "--out", str(out)]) == 2
    assert "--from RUN is needed" in capsys.readouterr().err
    assert main(["sft", "--from", str(base_run), "--data", str(sft_file), "--out", str(out), "--resume"]) == 2
    assert "no run to resume" in capsys.readouterr().err


def _sft_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from k3.cli import main; sys.exit(main(['sft'] + sys.argv[1:]))", *args]


def test_resume_after_sigkill_equals_an_uninterrupted_run(tmp_path, base_run, sft_file):
    # both runs in fresh processes with the same thread count, so CPU reductions round identically
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = ["--from", str(base_run), "--data", str(sft_file), "--max-steps", "6", "--eval-every", "3",
              "--checkpoint-every", "3", *SFT_ARGS]
    straight = tmp_path / "a"
    subprocess.run(_sft_cmd(*common, "--out", str(straight)), cwd=REPO, env=env, check=True, capture_output=True)
    expected = read_metrics(straight, "train")

    run = tmp_path / "b"
    proc = subprocess.Popen(_sft_cmd(*common, "--out", str(run)), cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:  # kill hard once the step-3 checkpoint exists and a later step was logged
        done = (run / "metrics.jsonl").exists() and any(r["step"] >= 4 for r in read_metrics(run, "train"))
        if latest_checkpoint(run / "checkpoints") is not None and done:
            break
        if proc.poll() is not None:
            pytest.fail("the SFT process ended before it could be killed")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # the resume names only the folder: the base run, the data and the settings come from run.json
    subprocess.run(_sft_cmd("--out", str(run), "--resume"), cwd=REPO, env=env, check=True, capture_output=True)
    resumed = read_metrics(run, "train")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for a, b in zip(expected, resumed):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]
    assert [r["loss"] for r in read_metrics(run, "eval")] == [r["loss"] for r in read_metrics(straight, "eval")]
    assert np.isfinite([r["loss"] for r in resumed]).all()
