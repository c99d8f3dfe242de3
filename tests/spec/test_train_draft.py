"""`k3 train-draft` end to end on the debug preset, from a short `k3 train` run: metrics and plots, a stop and resume
that equals an uninterrupted run, target-generated text, the command line and its refusals."""

import json
import signal

import numpy as np
import pytest
import torch

from k3.checkpoint import read_model
from k3.cli import main
from k3.runfolder import StopSignals
from k3.spec.train import DraftTrainConfig, load_draft, train_draft
from k3.train.config import ContextStage, TrainConfig
from k3.train.data import TokenizedCorpus
from k3.train.loop import train
from k3.train.metrics import MetricsLog
from tests.train.test_loop import write_corpus


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target_run(tmp_path_factory):
    """A debug-preset `k3 train` run of two steps: the target, with its tokenized corpus beside its checkpoint."""
    root = tmp_path_factory.mktemp("target")
    cfg = TrainConfig(preset="debug", data=str(write_corpus(root / "corpus", n_files=12)), out=str(root / "run"),
                      tokens_per_step=128, stages=[ContextStage(32, 1.0)], max_steps=2, eval_every=2, eval_tokens=128,
                      checkpoint_every=2, vocab_size=600, heldout_fraction=0.1, muon_ns_dtype="float32")
    train(cfg, progress=False, log=lambda *a: None)
    return root / "run"


def _cfg(target_run, out, **changes):
    cfg = DraftTrainConfig(init_from=str(target_run), out=str(out), seq_len=32, tokens_per_step=128, unroll_steps=3,
                           max_steps=4, eval_every=2, eval_tokens=128, checkpoint_every=2, device="cpu",
                           muon_ns_dtype="float32")
    for k, v in changes.items():
        setattr(cfg, k, v)
    return cfg


def _records(out, kind):
    records = [r for r in MetricsLog(out / "metrics.jsonl").read() if r["kind"] == kind]
    for r in records:
        r.pop("tokens_per_s", None)
    return records


def test_train_draft_runs_stops_and_resumes_exactly(target_run, tmp_path):
    quiet = dict(progress=False, log=lambda *a: None)
    whole = train_draft(_cfg(target_run, tmp_path / "whole"), **quiet)
    out = tmp_path / "whole"
    assert whole.steps == 4 and whole.stopped is None
    train_records, evals = _records(out, "train"), _records(out, "eval")
    assert [r["step"] for r in train_records] == [1, 2, 3, 4] and [r["step"] for r in evals] == [0, 2, 4]
    assert all(len(r["acceptance"]) == 3 and all(0 < a <= 1 for a in r["acceptance"]) for r in evals)
    assert whole.before["step"] == 0 and whole.after["step"] == 4
    assert {p.name for p in (out / "plots").iterdir()} >= {"loss.png", "optim.png", "acceptance.png"}
    # only the draft trained: its weights moved from their initialisation, and the checkpoint loads as a draft
    draft, info = load_draft(out)
    assert info["unroll_steps"] == 3 and info["feature_blocks"] == [1, 2]
    first = read_model(sorted((out / "checkpoints").iterdir())[0])
    assert any(not torch.equal(first[k], v) for k, v in draft.state_dict().items())

    stop = StopSignals()
    stop.signum = signal.SIGINT  # as if Ctrl-C came during the first step
    parts = tmp_path / "parts"
    first = train_draft(_cfg(target_run, parts), stop=stop, **quiet)
    assert first.stopped == "SIGINT" and first.steps == 1
    assert (parts / "checkpoints" / "step_00000001" / "COMMITTED").exists()
    rest = train_draft(_cfg(target_run, parts, max_steps=None), resume=True, **quiet)
    assert rest.start_step == 1 and rest.steps == 4
    assert _records(parts, "train") == train_records
    assert _records(parts, "eval") == evals
    resumed, _ = load_draft(parts)
    for (name, a), b in zip(draft.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name

    # the command line: a finished run is complete, a second start over it is refused
    assert main(["train-draft", "--out", str(parts), "--resume"]) == 0
    assert main(["train-draft", "--from", str(target_run), "--out", str(parts)]) == 2
    assert main(["train-draft", "--from", str(target_run), "--out", str(tmp_path / "none"), "--resume"]) == 2
    with pytest.raises(ValueError, match="different settings"):
        train_draft(_cfg(target_run, parts, lr=1.0), resume=True, **quiet)


def test_train_draft_on_target_generated_text(target_run, tmp_path):
    out = tmp_path / "generated"
    cfg = _cfg(target_run, out, text="generated", generated_documents=4, prompt_tokens=8, max_steps=1,
               tokens_per_step=64, eval_every=1, unroll_steps=2)
    summary = train_draft(cfg, progress=False, log=lambda *a: None)
    assert summary.steps == 1
    generated = TokenizedCorpus.open(out / "data" / "generated")
    source = TokenizedCorpus.open(target_run / "data" / "train")
    prompts = {tuple(source.document(i)[:8]) for i in range(source.num_documents)}
    assert generated.num_documents == 4
    for i in range(4):
        doc = np.asarray(generated.document(i))
        assert tuple(doc[:8]) in prompts and 8 < len(doc) <= 32
    assert json.loads((out / "run.json").read_text())["draft_config"]["text"] == "generated"


def test_train_draft_refusals(target_run, tmp_path):
    with pytest.raises(ValueError, match="--from is required"):
        train_draft(_cfg(target_run, tmp_path / "a", init_from=""), progress=False)
    with pytest.raises(ValueError, match="must exceed unroll_steps"):
        train_draft(_cfg(target_run, tmp_path / "a", seq_len=4, tokens_per_step=4, unroll_steps=3), progress=False)
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a k3 draft training run"):
        train_draft(_cfg(target_run, lonely), progress=False)
    assert (lonely / "notes.txt").read_text() == "mine"


def test_greedy_generated_text_is_the_targets_argmax(target_run, tmp_path):
    """`--generated-temperature 0` writes what a greedy engine would: every generated token is the target's argmax
    after the text before it (a full forward each, no cache)."""
    from k3.checkpoint import load_trained
    from k3.spec.train import generate_documents

    target, tokenizer, _ = load_trained(str(target_run))
    cfg = _cfg(target_run, tmp_path / "g", text="generated", generated_documents=3, prompt_tokens=8,
               generated_temperature=0.0)
    corpus = TokenizedCorpus.open(target_run / "data" / "train")
    sequences = generate_documents(target.eval(), corpus, tokenizer, cfg, log=lambda *a: None, progress=False)
    assert len(sequences) == 3
    with torch.no_grad():
        for seq in sequences:
            assert len(seq) > 8
            logits = target(torch.tensor([seq[:-1]])).logits[0, 7:]  # the positions that predicted seq[8:]
            assert logits.argmax(-1).tolist() == seq[8:]
