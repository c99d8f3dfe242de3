"""Teacher-forced prompt scoring (`k3.infer.score`) against the model's plain forward and the engine's own
log-likelihood of the tokens it generated.

Tolerance: LOGPROB_TOL as in test_engine.py (packing, pieces and batch size change only the summation order
of the reference MoE; measured differences are ~1e-6)."""

import threading

import pytest
import torch

from k3.infer.api import SamplingParams
from k3.infer.config import EngineConfig
from k3.infer.engine import AsyncEngine, Engine
from k3.infer.score import PromptScorer, scorer_for

LOGPROB_TOL = 1e-4


def prompt(n, seed, V=512):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def reference(model, ids):
    """log p(ids[t] | ids[:t]) for t >= 1 from one plain forward of the whole prompt -> [T-1]."""
    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_scores_equal_one_plain_forward(model):
    prompts = [prompt(n, seed) for seed, n in enumerate([1, 2, 7, 33, 64])]
    scorer = PromptScorer(model)
    for ids, s in zip(prompts, scorer.score(prompts, top=3)):
        assert s.ids == ids and s.logprobs.shape == (len(ids),)
        assert torch.isnan(s.logprobs[0])
        torch.testing.assert_close(s.logprobs[1:], reference(model, ids), atol=LOGPROB_TOL, rtol=0)
        # the alternatives are the best k, best first, and the actual token is among them when it is the argmax
        assert (s.top_logprobs[1:, :-1] >= s.top_logprobs[1:, 1:]).all()
        assert (s.top_logprobs[1:, 0] >= s.logprobs[1:] - 1e-6).all()
        entries = s.token_logprobs()
        assert entries[0] is None and [e.token_id for e in entries[1:]] == ids[1:]
        assert all(len(e.top) == 3 for e in entries[1:])


def test_long_prompts_in_pieces_and_packing(model):
    """A budget of 16 tokens per forward: prompts over it run in pieces over the cache, shorter ones packed."""
    V = model.config.vocab_size
    scorer = PromptScorer(model, max_logit_bytes=16 * 4 * V)
    assert scorer.tokens_per_forward == 16
    prompts = [prompt(n, 10 + n) for n in (5, 16, 17, 50, 48, 3)]
    for ids, s in zip(prompts, scorer.score(prompts, top=1)):
        torch.testing.assert_close(s.logprobs[1:], reference(model, ids), atol=LOGPROB_TOL, rtol=0)
        assert s.top_ids.shape == (len(ids), 1)


def test_totals_and_greedy(model):
    ids = prompt(20, 3)
    (s,) = PromptScorer(model).score([ids], top=1)
    ref = reference(model, ids)
    assert s.total(5) == pytest.approx(float(ref[4:].sum()), abs=1e-3)
    assert s.total(5, 9) == pytest.approx(float(ref[4:8].sum()), abs=1e-3)
    best = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).argmax(-1).tolist()
    assert s.greedy(1) == all(best[t - 1] == ids[t] for t in range(1, 20))
    with pytest.raises(ValueError, match="position 0"):
        s.total(0)


def test_refuses_bad_input(model):
    scorer = PromptScorer(model)
    with pytest.raises(ValueError, match="empty"):
        scorer.score([[]])
    with pytest.raises(ValueError, match="token ids"):
        scorer.score([[1, 512]])
    with pytest.raises(ValueError, match="top"):
        scorer.score([[1, 2]], top=-1)


def test_prompt_scores_equal_the_engines_own_logprobs(model):
    """Generate greedily with logprobs, then score prompt + generated: the generated positions' scores are the
    engine's own log-likelihoods of those tokens."""
    config = EngineConfig(hash_block_size=8, page_tokens=16, num_pages=160, max_running=8, eos_token_ids=())
    engine = Engine(model, config)
    scorer = scorer_for(engine)
    assert scorer is not None and scorer.model is model
    for seed in range(3):
        ids = prompt(11 + 7 * seed, seed)
        out = engine.generate(ids, SamplingParams(max_tokens=12, temperature=0.0, logprobs=2))
        (s,) = scorer.score([ids + out.new_token_ids], top=2)
        engine_lps = torch.tensor([e.logprob for e in out.logprobs])
        torch.testing.assert_close(s.logprobs[len(ids):], engine_lps, atol=LOGPROB_TOL, rtol=0)
        for e, row_ids in zip(out.logprobs, s.top_ids[len(ids):].tolist()):
            assert [t for t, _ in e.top] == row_ids


def test_scorer_shares_the_async_engines_lock(model):
    aeng = AsyncEngine(Engine(model, EngineConfig(hash_block_size=8, page_tokens=16, num_pages=160, eos_token_ids=())))
    try:
        scorer = scorer_for(aeng)
        assert scorer.lock is aeng._engine_lock
        # while the engine's lock is held, a scoring forward waits for it
        done = threading.Event()
        with aeng._engine_lock:
            t = threading.Thread(target=lambda: (scorer.score([prompt(8, 1)]), done.set()))
            t.start()
            assert not done.wait(0.3)
        assert done.wait(30)
        t.join()
    finally:
        aeng.shutdown()
    assert scorer_for(object()) is None
