"""Speculative decoding in the engine (docs/speculative.md): exact acceptance, greedy equality with plain decoding,
KDA / conv / MLA rollback in both forms, prefix caching and preemption alongside, usage counts and metrics.

Drafters: `ScriptedDrafter` proposes the target's own greedy continuation with some proposals corrupted (so every
step mixes acceptances and rejections at chosen positions), `DraftRunner` runs a real (untrained) draft model.
Tolerances: states after a rollback equal a fresh recurrence over the accepted prefix to STATE_TOL (the verify
pass and a plain forward batch the MoE and the KDA recurrence differently; differences are ~1e-6).
"""

import random

import pytest
import torch
from scipy.stats import chisquare

from k3.config import get_preset
from k3.infer.api import SamplingParams
from k3.infer.cache import gather
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.infer.metrics import render_prometheus
from k3.infer.speculative import accept, rollback_bytes
from k3.model.cache import KDAState, MLALatent
from k3.model.model import build_model
from k3.spec.draft import build_draft
from k3.spec.drafter import DraftRunner
from tests.infer.test_engine import prompt, run

STATE_TOL = 1e-4
CFG = {"hash_block_size": 8, "page_tokens": 16, "prefill_chunk_tokens": 16, "checkpoint_every_blocks": 2,
       "num_pages": 160, "max_step_tokens": 64, "max_running": 8, "eos_token_ids": ()}


class ScriptedDrafter:
    """Drafts from a script: `future[rid]` is the request's whole token stream (prompt + the target's greedy
    output); a proposal is the true next token unless `wrong(rid, position)` says to corrupt it. Logits are one-hot
    (scaled), so greedy drafting picks the scripted token."""

    feature_blocks = (1, 2)

    def __init__(self, vocab: int, future: dict, wrong):
        self.vocab, self.future, self.wrong = vocab, future, wrong
        self.position: dict[str, int] = {}
        self.extended: list[tuple[str, int, int]] = []  # (rid, start, n) of every extend

    def _logits(self, rids):
        out = torch.full((len(rids), self.vocab), -30.0)
        for r, rid in enumerate(rids):
            pos, stream = self.position[rid], self.future.get(rid, [])
            tok = stream[pos] if pos < len(stream) else 0
            if self.wrong(rid, pos):
                tok = (tok + 1) % self.vocab
            out[r, tok] = 30.0
        return out

    def extend(self, rids, starts, features, next_tokens):
        for rid, s, f, t in zip(rids, starts, features, next_tokens):
            assert f.shape[0] == len(t)
            self.extended.append((rid, s, len(t)))
            self.position[rid] = s + len(t) + 1
        return self._logits(rids)

    def propose(self, rids, tokens):
        for rid in rids:
            self.position[rid] += 1
        return self._logits(rids)

    def release(self, rid):
        self.position.pop(rid, None)


@pytest.fixture(scope="module")
def tiny_model():
    return build_model(get_preset("tiny"), seed=0).eval()


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0)


def plain_outputs(model, arrivals, **cfg):
    return {rid: o.new_token_ids for rid, o in run(Engine(model, EngineConfig(**{**CFG, **cfg})), arrivals).items()}


# ------------------------------------------------------------------------------------------------ acceptance (unit)


def test_accept_greedy_stops_at_first_mismatch():
    V = 8
    best = [3, 1, 4, 1]
    p = torch.zeros(4, V, dtype=torch.float64)
    p[torch.arange(4), torch.tensor(best)] = 1
    q = torch.full((3, V), 1 / V, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    assert accept(p, q, [3, 1, 4], g, greedy=True) == ([3, 1, 4, 1], 3)  # all pass: the bonus token
    assert accept(p, q, [3, 2, 4], g, greedy=True) == ([3, 1], 1)  # corrected at the first mismatch
    assert accept(p, q, [0, 1, 4], g, greedy=True) == ([3], 0)


def _random_dist(V, g, peak):
    return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * peak, -1)


def test_accept_emits_the_target_distribution():
    """Chi-squared over many seeded draws: the first emitted token follows p_0, and the second (emitted whenever
    draft 0 was accepted) follows p_1, although drafts come from a quite different q."""
    V, runs = 6, 20000
    g = torch.Generator().manual_seed(1)
    p = torch.stack([_random_dist(V, g, 1.5) for _ in range(3)])
    q = torch.stack([_random_dist(V, g, 1.5) for _ in range(2)])
    assert (p[:2] - q).abs().sum(-1).min() > 0.4  # far apart: a biased test would show
    first, second = torch.zeros(V), torch.zeros(V)
    for seed in range(runs):
        gen = torch.Generator().manual_seed(seed)
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        tokens, a = accept(p, q, drafts, gen, greedy=False)
        assert tokens[:a] == drafts[:a] and len(tokens) == a + 1
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    for counts, target in ((first, p[0]), (second, p[1])):
        expected = target * counts.sum()
        assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_accept_is_reproducible_from_the_seed():
    V = 10
    g = torch.Generator().manual_seed(2)
    p = torch.stack([_random_dist(V, g, 1.0) for _ in range(4)])
    q = torch.stack([_random_dist(V, g, 1.0) for _ in range(3)])
    draws = [accept(p, q, [1, 2, 3], torch.Generator().manual_seed(7), greedy=False) for _ in range(2)]
    assert draws[0] == draws[1]


# ------------------------------------------------------------------------------------------ greedy equals plain


def _scripted(model, arrivals, expected, fraction_wrong, seed=0):
    rng = random.Random(seed)
    bad = {}

    def wrong(rid, pos):
        return bad.setdefault((rid, pos), rng.random() < fraction_wrong)

    future = {rid: ids + expected[rid] for _, rid, ids, _ in arrivals}
    return ScriptedDrafter(model.config.vocab_size, future, wrong)


@pytest.mark.parametrize("form", ["snapshot", "replay"])
@pytest.mark.parametrize("preset", ["debug", "tiny"])
def test_greedy_speculative_equals_plain_batch_one(model, tiny_model, preset, form):
    target = model if preset == "debug" else tiny_model
    V = target.config.vocab_size
    arrivals = [(0, "a", prompt(37, 1, V), greedy(24))]
    expected = plain_outputs(target, arrivals)
    drafter = _scripted(target, arrivals, expected, 0.3)
    engine = Engine(target, EngineConfig(**CFG, speculative_tokens=4, spec_rollback=form), drafter=drafter)
    outs = run(engine, arrivals)
    assert outs["a"].new_token_ids == expected["a"]
    assert 0 < outs["a"].accepted_prediction_tokens and 0 < outs["a"].rejected_prediction_tokens
    assert engine.metrics_state.counters["spec_verifies_total"] < 24  # several tokens per verify


@pytest.mark.parametrize("form", ["snapshot", "replay"])
def test_greedy_speculative_equals_plain_mixed_batch(model, form):
    """Requests of different lengths arriving at different steps (their prefill pieces ride along verifies), a
    shared prefix (prefix-cache hits and KDA checkpoints), different drafts counts (max_tokens caps them)."""
    V = model.config.vocab_size
    shared = prompt(40, 9, V)
    arrivals = [(0, "a", prompt(29, 1, V), greedy(30)), (0, "b", shared + prompt(5, 2, V), greedy(17)),
                (3, "c", prompt(70, 3, V), greedy(25)), (6, "d", shared + prompt(11, 4, V), greedy(3)),
                (9, "e", prompt(8, 5, V), greedy(1))]
    expected = plain_outputs(model, arrivals)
    drafter = _scripted(model, arrivals, expected, 0.35)
    engine = Engine(model, EngineConfig(**CFG, speculative_tokens=3, spec_rollback=form), drafter=drafter)
    outs = run(engine, arrivals)
    assert {rid: o.new_token_ids for rid, o in outs.items()} == expected
    assert engine.metrics_state.counters["prefix_hits_total"] > 0


def test_greedy_speculative_with_preemption(model):
    V = model.config.vocab_size
    arrivals = [(0, r, prompt(30 + 7 * i, 20 + i, V), greedy(40)) for i, r in enumerate("abcd")]
    cfg = {"num_pages": 34, "max_running": 4}
    expected = plain_outputs(model, arrivals, **cfg)
    drafter = _scripted(model, arrivals, expected, 0.3)
    engine = Engine(model, EngineConfig(**{**CFG, **cfg}, speculative_tokens=4), drafter=drafter)
    outs = run(engine, arrivals)
    assert {rid: o.new_token_ids for rid, o in outs.items()} == expected
    assert engine.metrics_state.counters["preemptions_total"] > 0


@pytest.mark.parametrize("preset", ["debug", "tiny"])
def test_greedy_with_a_draft_model(model, tiny_model, preset):
    """The real draft (untrained, so mostly rejected) through `DraftRunner`: the output is still the target's."""
    target = model if preset == "debug" else tiny_model
    V = target.config.vocab_size
    arrivals = [(0, "a", prompt(23, 1, V), greedy(12)), (1, "b", prompt(41, 2, V), greedy(9))]
    expected = plain_outputs(target, arrivals)
    drafter = DraftRunner(build_draft(target.config, seed=3), target)
    outs = run(Engine(target, EngineConfig(**CFG, speculative_tokens=3), drafter=drafter), arrivals)
    assert {rid: o.new_token_ids for rid, o in outs.items()} == expected
    assert not drafter.caches  # released when the requests finished


# ----------------------------------------------------------------------------------------------------- rollback


def test_verify_features_equal_the_training_features(model):
    """The verify pass's features (an incremental ragged forward with `blocks=`) are `target_features`' exactly."""
    from k3.infer.speculative import forward_with_features
    from k3.model.sequence import SequenceLayout
    from k3.spec.draft import target_features

    ids = torch.tensor([prompt(30, 8, model.config.vocab_size)])
    with torch.no_grad():
        ref, logits = target_features(model, ids, SequenceLayout.build(1, 30, None, "cpu"), (1, 2))
        cache = model.new_cache(1)
        got_logits, got = forward_with_features(model, ids, [0, 30], cache, torch.arange(30), (1, 2))
    torch.testing.assert_close(got, ref[0], atol=0, rtol=0)
    torch.testing.assert_close(got_logits, logits[0], atol=0, rtol=0)


def _fresh_state(model, tokens):
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.tensor([tokens]), cache=cache)
    return cache


@pytest.mark.parametrize("form", ["snapshot", "replay"])
def test_rollback_after_a_rejection_at_every_position(model, form):
    """Drafts 0 … j − 1 right and draft j wrong, for every j (j = k: all right, the bonus): after the verify the
    KDA states, conv tails and MLA latents of the sequence equal a fresh forward over its verified tokens. One engine
    with prefix caching: from the second request on, the prompt's state comes from the cache."""
    k, V = 4, model.config.vocab_size
    ids = prompt(35, 4, V)
    expected = plain_outputs(model, [(0, "a", ids, greedy(k + 3))])["a"]
    target = {}
    drafter = ScriptedDrafter(V, {f"a{j}": ids + expected for j in range(k + 1)},
                              lambda rid, pos: pos == len(ids) + 1 + target[rid])  # the j-th draft of the first verify
    engine = Engine(model, EngineConfig(**CFG, speculative_tokens=k, spec_rollback=form), drafter=drafter)
    for j in range(k + 1):
        rid = f"a{j}"
        target[rid] = j
        engine.add_request(rid, ids, greedy(k + 3))
        seq = engine.requests[rid]
        while not seq.output_ids:
            engine.step()  # prefill pieces, the first token, then k drafts
        assert len(seq.draft_tokens) == k
        engine.step()  # the verify
        assert seq.accepted_tokens == j and seq.num_computed == len(ids) + 1 + j
        assert seq.output_ids == expected[: j + 2]
        assert j == 0 or seq.cached_tokens > 0
        fresh = _fresh_state(model, seq.tokens[: seq.num_computed])
        mine = gather(engine.pool, [seq.blocks], [seq.kda_pages], [seq.num_computed])
        for layer, (a, b) in enumerate(zip(mine.layers, fresh.layers)):
            if isinstance(b, KDAState):
                for name in ("recurrent", "conv_q", "conv_k", "conv_v"):
                    torch.testing.assert_close(getattr(a, name), getattr(b, name).to(getattr(a, name).dtype),
                                               atol=STATE_TOL, rtol=STATE_TOL, msg=f"{form} j={j} {layer} {name}")
            else:
                assert isinstance(b, MLALatent)
                torch.testing.assert_close(a.latent[:, : seq.num_computed], b.latent, atol=STATE_TOL, rtol=STATE_TOL)
        engine.abort(rid)


def test_snapshot_and_replay_agree(model):
    V = model.config.vocab_size
    arrivals = [(0, "a", prompt(33, 6, V), greedy(20)), (2, "b", prompt(19, 7, V), greedy(20))]
    expected = plain_outputs(model, arrivals)
    states = {}
    for form in ("snapshot", "replay"):
        engine = Engine(model, EngineConfig(**CFG, speculative_tokens=3, spec_rollback=form),
                        drafter=_scripted(model, arrivals, expected, 0.4))
        for _, rid, ids, sp in arrivals:
            engine.add_request(rid, ids, sp)
        for _ in range(6):
            engine.step()
        seq = engine.requests["a"]
        states[form] = engine.pool.kda_state[torch.tensor(seq.kda_pages)].clone(), seq.num_computed
    assert states["snapshot"][1] == states["replay"][1]
    torch.testing.assert_close(states["snapshot"][0], states["replay"][0], atol=1e-6, rtol=1e-6)


def test_unverified_tokens_never_reach_the_prefix_cache(model):
    """A request whose drafts were all rejected leaves only verified blocks and states behind: a follow-up
    continuing its text gets the same output from the cache as from a cold engine, and a prompt made of its
    rejected drafts hits nothing beyond the verified prefix."""
    V, k = model.config.vocab_size, 4
    ids = prompt(37, 11, V)
    expected = plain_outputs(model, [(0, "a", ids, greedy(30))])["a"]
    drafter = ScriptedDrafter(V, {"generate-0": ids + expected}, lambda rid, pos: True)
    engine = Engine(model, EngineConfig(**CFG, speculative_tokens=k), drafter=drafter)
    out = engine.generate(ids, greedy(30))
    assert out.new_token_ids == expected and out.accepted_prediction_tokens == 0
    follow = ids + expected + prompt(5, 12, V)
    cold = Engine(model, EngineConfig(**CFG)).generate(follow, greedy(8)).new_token_ids
    drafter.future["generate-1"] = follow + cold
    warm = engine.generate(follow, greedy(8))
    assert warm.cached_tokens > len(ids) and warm.new_token_ids == cold
    # drafts (always the true token + 1) after the prompt: never cached
    bogus = ids + [(expected[0] + 1) % V] * 16
    assert engine.generate(bogus, greedy(1)).cached_tokens <= len(ids)


# ------------------------------------------------------------------------------------------- sampling, end to end


def test_engine_sampling_follows_the_target():
    """Chi-squared over 640 seeded requests on a 16-token vocabulary: the first token a verify emits (the
    second output token) is distributed as the target's, marginalised over the first, with a draft whose own
    distribution differs."""
    config = get_preset("debug", vocab_size=16)
    target = build_model(config, seed=0).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(30)  # peaky p and q: far apart, so a biased acceptance would show
    ids = [1, 5, 9, 2, 7]
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([ids])).logits[0, -1].double(), -1)
        p2 = torch.stack([torch.softmax(target(torch.tensor([ids + [x]])).logits[0, -1].double(), -1)
                          for x in range(16)])
    second = p1 @ p2
    n = 640
    counts = torch.zeros(16)
    accepted = 0
    engine = Engine(target, EngineConfig(**{**CFG, "max_running": 64}, short_budget_tokens=10**6, speculative_tokens=2),
                    drafter=DraftRunner(build_draft(config, seed=5), target))
    arrivals = [(0, f"r{s}", ids, SamplingParams(max_tokens=3, temperature=1.0, seed=s)) for s in range(n)]
    outs = run(engine, arrivals)
    for o in outs.values():
        counts[o.new_token_ids[1]] += 1
        accepted += o.accepted_prediction_tokens
    assert 0 < accepted < 2 * n  # both outcomes happen
    keep = second * n >= 5  # chi-squared needs expected counts of 5 or more: pool the rest
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([second[keep], second[~keep].sum()[None]]) * n
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3


def test_seeded_sampling_is_reproducible(model):
    V = model.config.vocab_size
    arrivals = [(0, "a", prompt(20, 1, V), SamplingParams(max_tokens=15, temperature=0.8, top_k=20, seed=3))]
    outs = [run(Engine(model, EngineConfig(**CFG, speculative_tokens=3),
                       drafter=DraftRunner(build_draft(model.config, seed=1), model)), arrivals)["a"].new_token_ids
            for _ in range(2)]
    assert outs[0] == outs[1]


# --------------------------------------------------------------------------------------------- usage and metrics


def test_usage_counts_and_metrics(model):
    V = model.config.vocab_size
    arrivals = [(0, "a", prompt(30, 1, V), greedy(20))]
    expected = plain_outputs(model, arrivals)
    engine = Engine(model, EngineConfig(**CFG, speculative_tokens=4),
                    drafter=_scripted(model, arrivals, expected, 0.3))
    out = run(engine, arrivals)["a"]
    c = engine.metrics_state.counters
    assert out.accepted_prediction_tokens == c["spec_accepted_tokens_total"] > 0
    assert out.accepted_prediction_tokens + out.rejected_prediction_tokens == c["spec_draft_tokens_total"]
    snap = engine.metrics()
    assert snap["spec_acceptance_rate"] == pytest.approx(c["spec_accepted_tokens_total"] / c["spec_draft_tokens_total"])
    assert snap["spec_tokens_per_verify"] == pytest.approx(c["spec_emitted_tokens_total"] / c["spec_verifies_total"])
    text = render_prometheus(snap)
    assert "k3_spec_acceptance_rate" in text and "k3_spec_tokens_per_verify" in text
    assert sum(engine.spec_position_accepted) == c["spec_accepted_tokens_total"]


def test_rollback_memory(model):
    from k3.infer.cache import CacheSpec

    spec = CacheSpec.build(model.config, 8, torch.float32, 16)
    snap, replay = rollback_bytes(spec, 4, "snapshot"), rollback_bytes(spec, 4, "replay")
    P = spec.num_heads * spec.head_dim
    n_kda = len(spec.kda_layers)
    assert snap == n_kda * 5 * (spec.kda_state_bytes + spec.kda_conv_bytes)
    assert replay == n_kda * 5 * (7 * P + spec.num_heads) * 4
    with pytest.raises(ValueError):
        rollback_bytes(spec, 4, "copy")


def test_speculative_config_is_checked(model):
    with pytest.raises(ValueError, match="drafter"):
        Engine(model, EngineConfig(**CFG, speculative_tokens=2))
    with pytest.raises(ValueError, match="spec_rollback"):
        Engine(model, EngineConfig(**CFG, speculative_tokens=2, spec_rollback="copy"), drafter=object())
