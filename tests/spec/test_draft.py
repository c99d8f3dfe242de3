"""The draft's math: the LK loss, W_E3 at initialisation, the target's features, the training-time test's attention
and which states each unrolled step uses, checked against the inference-time chain by hand."""

import math

import pytest
import torch

from k3.config import get_preset
from k3.model.model import build_model
from k3.model.sequence import SequenceLayout
from k3.spec.draft import (build_draft, draft_logits, feature_blocks, log_acceptance, lk_loss,
                           target_features, tokens_per_verify, ttt_attention, ttt_attention_reference, unroll,
                           unrolled_loss)


@pytest.fixture(scope="module")
def config():
    return get_preset("debug").replace(mla_impl="naive")


@pytest.fixture(scope="module")
def target(config):
    model = build_model(config, seed=1, dtype=torch.float64).eval()
    return model.requires_grad_(False)


def test_lk_loss_gradcheck_float64():
    gen = torch.Generator().manual_seed(0)
    p_logp = torch.log_softmax(torch.randn(5, 13, generator=gen, dtype=torch.float64) * 2, -1)
    q = torch.randn(5, 13, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda logits: lk_loss(p_logp, logits), (q,))
    # the definition: −log Σ_x min(p(x), q(x))
    direct = -torch.minimum(p_logp.exp(), torch.softmax(q, -1)).sum(-1).log()
    torch.testing.assert_close(lk_loss(p_logp, q), direct, rtol=1e-12, atol=1e-12)


def test_acceptance_of_a_draft_equal_to_the_target_is_one():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 300, generator=gen, dtype=torch.float64) * 3
    p_logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(log_acceptance(p_logp, logits).exp(), torch.ones(7, dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert lk_loss(p_logp, logits).abs().max() < 1e-12
    # any other draft is accepted less often: Σ min(p, q) = 1 − TV(p, q)
    other = logits + torch.randn(7, 300, generator=gen, dtype=torch.float64)
    tv = 0.5 * (p_logp.exp() - torch.softmax(other, -1)).abs().sum(-1)
    torch.testing.assert_close(log_acceptance(p_logp, other).exp(), 1 - tv, rtol=1e-12, atol=1e-12)
    assert (log_acceptance(p_logp, other) < 0).all()


def test_tokens_per_verify():
    assert tokens_per_verify([0.8] * 4) == pytest.approx((1 - 0.8 ** 5) / (1 - 0.8))
    assert tokens_per_verify([1.0, 1.0, 1.0]) == 4.0
    assert tokens_per_verify([0.5, 0.4], k=1) == 1.5
    assert tokens_per_verify([0.9, 0.5], k=2) == pytest.approx(1 + 0.9 + 0.45)


def test_feature_blocks_by_preset():
    # K3's 8 blocks give the report's 1 and 4; smaller presets the middle block
    assert feature_blocks(get_preset("k3")) == (1, 4)
    assert feature_blocks(get_preset("small")) == (1, 4)  # 7 blocks
    assert feature_blocks(get_preset("tiny")) == (1, 3)  # 5 blocks
    assert feature_blocks(get_preset("debug")) == (1, 2)  # 3 blocks


def test_target_features_are_the_attnres_blocks_and_the_output_read(config, target):
    D = config.hidden_size
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    layout = SequenceLayout(2, 11)
    features, logits = target_features(target, ids, layout, feature_blocks(config))
    # the last third is the output read: through the final norm and head it gives the target's logits exactly
    assert torch.equal(target.lm_head(target.model.norm(features[..., 2 * D:])), logits)
    torch.testing.assert_close(logits, target(ids).logits, rtol=0, atol=0)
    # block 1 is layers 0 and 1 (block size 2): the sum of their mixer and FFN outputs, the embedding excluded
    reps = []
    target.model(ids, layout, blocks=reps)
    assert len(reps) == math.ceil(config.num_hidden_layers / config.attn_res_block_size) + 2
    assert torch.equal(reps[0], target.model.embed_tokens(ids))
    assert torch.equal(features[..., :D], reps[1]) and torch.equal(features[..., D:2 * D], reps[2])
    # the two-phase wiring exposes the same blocks
    two_phase = build_model(config.replace(attn_res_impl="two_phase"), seed=1, dtype=torch.float64).eval()
    features_2, _ = target_features(two_phase, ids, layout, feature_blocks(config))
    torch.testing.assert_close(features_2, features, rtol=1e-12, atol=1e-12)


def test_w_e3_at_init_reproduces_the_final_feature_path(config, target):
    D = config.hidden_size
    draft = build_draft(config, seed=3, dtype=torch.float64)
    assert torch.equal(draft.fc.weight[:, :2 * D], torch.zeros(D, 2 * D, dtype=torch.float64))
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    layout = SequenceLayout(2, 8)
    features, _ = target_features(target, ids, SequenceLayout(2, 9), draft.feature_blocks)
    embeds = target.model.embed_tokens(ids[:, 1:])
    final = features[:, :-1, 2 * D:]
    assert torch.equal(draft.fuse(features[:, :-1]), final)
    # the whole step: the draft fed the fused features equals the draft fed the output read alone
    fused, _ = draft(draft.fuse(features[:, :-1]), embeds, layout)
    alone, _ = draft(final, embeds, layout)
    assert torch.equal(fused, alone)


def test_ttt_attention_matches_the_masked_reference(config):
    draft = build_draft(config, seed=4, dtype=torch.float64)
    gen = torch.Generator().manual_seed(4)
    B, T, D = 2, 13, config.hidden_size
    segments = SequenceLayout.build(B, T, torch.tensor([0, 5, 13, 20, 26]), "cpu").segment_ids
    latents = [draft.self_attn.latent(torch.randn(B, T, D, generator=gen, dtype=torch.float64)) for _ in range(5)]
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    for k in range(1, 6):
        torch.testing.assert_close(ttt_attention(draft.self_attn, x, latents[:k], segments),
                                   ttt_attention_reference(draft.self_attn, x, latents[:k], segments),
                                   rtol=1e-12, atol=1e-12)
    # step 1 is the block's ordinary causal attention over packed documents
    layout = SequenceLayout.build(B, T, torch.tensor([0, 5, 13, 20, 26]), "cpu")
    x1 = draft.input_layernorm(x)
    step1 = ttt_attention(draft.self_attn, x1, [draft.self_attn.latent(x1)], segments)
    torch.testing.assert_close(step1, draft.self_attn(x1, layout)[0], rtol=1e-12, atol=1e-12)


def test_the_unroll_equals_drafting_with_a_cache(config):
    """Step k at position t is what the draft computes at inference when it drafts k tokens after anchor
    s = t − k + 1: a causal pass over positions ≤ s on the target's features, then one position at a time, each
    fed the draft's own previous output and attending to the cache."""
    draft = build_draft(config, seed=5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    T, D, K = 8, config.hidden_size, 4
    with torch.no_grad():
        draft.fc.weight.normal_(0, 0.05, generator=gen)  # all three features matter
        features = torch.randn(1, T, 3 * D, generator=gen, dtype=torch.float64)
        embeds = torch.randn(1, T, D, generator=gen, dtype=torch.float64)
        steps = unroll(draft, features, embeds, torch.zeros(1, T, dtype=torch.long), K)
        for s in range(T):
            g, state = draft(draft.fuse(features[:, : s + 1]), embeds[:, : s + 1], SequenceLayout(1, s + 1),
                             use_cache=True)
            torch.testing.assert_close(steps[0][:, s], g[:, s], rtol=1e-12, atol=1e-12)
            hidden = g[:, s:]
            for k in range(2, K + 1):
                t = s + k - 1
                if t >= T:
                    break
                hidden, state = draft(hidden, embeds[:, t:t + 1], SequenceLayout(1, 1), state, use_cache=True)
                torch.testing.assert_close(steps[k - 1][:, t], hidden[:, 0], rtol=1e-12, atol=1e-12)


def test_each_step_reads_the_target_only_up_to_its_anchor(config):
    """Beyond step 1 the newest position uses the draft's own state: step k at t depends on the target's features
    at positions ≤ t − k + 1 and on no later one."""
    draft = build_draft(config, seed=6, dtype=torch.float64)
    gen = torch.Generator().manual_seed(6)
    T, D, K = 9, config.hidden_size, 4
    with torch.no_grad():
        draft.fc.weight.normal_(0, 0.05, generator=gen)
    features = torch.randn(1, T, 3 * D, generator=gen, dtype=torch.float64, requires_grad=True)
    embeds = torch.randn(1, T, D, generator=gen, dtype=torch.float64)
    steps = unroll(draft, features, embeds, torch.zeros(1, T, dtype=torch.long), K)
    t = 7
    for k in range(1, K + 1):
        (grad,) = torch.autograd.grad(steps[k - 1][0, t].sum(), features, retain_graph=True)
        reached = grad[0].abs().sum(-1) > 0  # [T]
        assert reached[: t - k + 2].all() and not reached[t - k + 2:].any(), (k, reached)


def test_unrolled_loss_counts_positions_within_documents(config, target):
    draft = build_draft(config, seed=7, dtype=torch.float64)
    ids = torch.randint(0, config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(7))
    labels = torch.roll(ids, -1, 1)
    labels[0, 3] = labels[0, 9] = -100  # documents [0, 4) and [4, 10)
    result = unrolled_loss(draft, target, ids, labels, torch.tensor([0, 4, 10]), steps=4)
    # step k counts t with t+1 in t's document and t − k + 1 ≥ its start: doc 0 {0,1,2}, doc 1 {4 … 8}
    assert result.counts.tolist() == [3 + 5, 2 + 4, 1 + 3, 0 + 2]
    assert torch.allclose(result.loss, result.loss_sums.sum())
    assert ((result.acceptance_sums / result.counts.clamp(min=1)) <= 1).all()
    result.loss.backward()
    assert all(p.grad is None for p in target.parameters())
    missing = [n for n, p in draft.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing
    # the mean over valid positions and steps is what draft_logits and log_acceptance give position by position
    with torch.no_grad():
        p = torch.log_softmax(target(ids, cu_seqlens=torch.tensor([0, 4, 10])).logits[0, 1:], -1)
        g = unroll(draft, target_features(target, ids, SequenceLayout.build(1, 10, torch.tensor([0, 4, 10]), "cpu"),
                                          draft.feature_blocks)[0][:, :-1], target.model.embed_tokens(ids[:, 1:]),
                   torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1]]), 1)[0]
    step1 = -log_acceptance(p, draft_logits(target, g[0]))[[0, 1, 2, 4, 5, 6, 7, 8]].sum()
    torch.testing.assert_close(result.loss_sums[0], step1, rtol=1e-10, atol=1e-10)
