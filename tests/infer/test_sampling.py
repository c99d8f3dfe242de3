"""Batched per-request sampling: greedy, temperature, top-k/top-p/min-p, penalties, seeds, logprobs."""

import math

import pytest
import torch

from k3.infer.api import SamplingParams
from k3.infer.sampling import apply_penalties, sample


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_and_draws_nothing():
    logits = torch.randn(4, 50, generator=gen(0))
    g = [gen(i) for i in range(4)]
    states = [x.get_state() for x in g]
    tokens, lps = sample(logits, [SamplingParams(temperature=0.0)] * 4, g)
    assert tokens == logits.argmax(-1).tolist() and lps == [None] * 4
    assert all(torch.equal(x.get_state(), s) for x, s in zip(g, states))


def test_same_seed_same_tokens_whatever_the_batch():
    V = 64
    row = torch.randn(V, generator=gen(1))
    sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=7)
    alone = [sample(row[None], [sp], [gen(7)])[0][0] for _ in range(3)]
    assert len(set(alone)) == 1
    others = torch.randn(5, V, generator=gen(2))
    for pos in range(3):
        batch = torch.cat([others[:pos], row[None], others[pos:]])
        params = [SamplingParams(temperature=1.3, seed=i) for i in range(5)]
        params.insert(pos, sp)
        gens = [gen(i) for i in range(5)]
        gens.insert(pos, gen(7))
        assert sample(batch, params, gens)[0][pos] == alone[0]


def test_temperature_sampling_matches_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    g = gen(3)
    n = 4000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[sample(logits, [SamplingParams(temperature=0.7)], [g])[0][0]] += 1
    p = torch.softmax(logits[0] / 0.7, -1)
    # each frequency within 5 standard deviations of its expectation
    assert ((counts / n - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-3).all()


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))
    cases = [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.7), {0, 1}),  # 0.5 < 0.7, 0.75 >= 0.7: the first two
        (SamplingParams(top_p=0.8), {0, 1, 2}),
        (SamplingParams(min_p=0.35), {0, 1}),  # p >= 0.35 * 0.5
        (SamplingParams(top_k=1), {0}),
        (SamplingParams(top_p=1e-6), {0}),
        (SamplingParams(min_p=1.0), {0}),
    ]
    g = gen(4)
    for sp, support in cases:
        seen = {sample(logits, [sp], [g])[0][0] for _ in range(300)}
        assert seen == support, sp


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    sp = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits, [sp], [[0]], [[1]])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # seen: 0 (prompt) and 1 (output)
    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [sp], [[0]], [[2, 2, 3]])  # the prompt does not count here
    assert out.tolist() == [[2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25]]
    assert apply_penalties(logits, [SamplingParams()], [[0]], [[1]]) is logits
    # greedy with a penalty picks the penalized argmax
    tokens, _ = sample(logits, [SamplingParams(temperature=0, presence_penalty=2.0)], [gen(0)], [[]], [[0]])
    assert tokens == [2]


def test_logprobs_are_the_raw_distribution():
    logits = torch.randn(2, 30, generator=gen(5))
    params = [SamplingParams(temperature=0.5, logprobs=3, seed=1), SamplingParams(temperature=0, logprobs=0)]
    tokens, lps = sample(logits, params, [gen(1), gen(2)])
    ref = torch.log_softmax(logits, -1)
    for i, lp in enumerate(lps):
        assert lp.token_id == tokens[i] and math.isclose(lp.logprob, float(ref[i, tokens[i]]), abs_tol=1e-6)
    top = lps[0].top
    assert [t for t, _ in top] == ref[0].topk(3).indices.tolist() and lps[1].top == []
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))


@pytest.mark.parametrize("field,value", [("top_p", 0.0), ("temperature", -0.5), ("logprobs", 21), ("top_k", -1),
                                         ("max_tokens", 0), ("stop_token_ids", (999,))])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate(vocab_size=512)
