"""Quantile Balancing: the exact rule, the histogram estimator, and their agreement (docs/architecture.md §6.3).

Legend: N routed tokens, E experts, B histogram bins, k experts per token.
"""

import pytest
import torch

from k3.model.quantile_balancing import (
    QuantileHistogram,
    expert_loads,
    imbalance_from_stats,
    imbalance_metrics,
    layer_load_stats,
    qb_exact,
    required_bias,
    route_topk_with_cutoff,
)

TOY_SCORES = [
    [0.74, 0.40, 0.52, 0.69],
    [0.54, 0.51, 0.48, 0.36],
    [0.57, 0.47, 0.76, 0.54],
    [0.61, 0.70, 0.44, 0.14],
    [0.61, 0.88, 0.08, 0.59],
    [0.17, 0.30, 0.10, 0.25],
    [0.79, 0.55, 0.16, 0.31],
    [0.80, 0.73, 0.69, 0.27],
]


def skewed_scores(m: int, num_experts: int, seed: int, spread: float = 2.0) -> torch.Tensor:
    """Sigmoid router scores [m, E] with a per-expert logit offset, so low-index experts are favoured."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, num_experts, generator=g) + torch.linspace(spread, -spread, num_experts)
    return torch.sigmoid(logits)


def histogram_bias(bias, scores, cutoff, top_k, token_mask=None, center=True):
    hist = QuantileHistogram(bias, num_bins=1000)
    hist.add(scores, cutoff, token_mask)
    return hist.bias(top_k, center=center), hist


def test_toy_case():
    scores = torch.tensor(TOY_SCORES)  # [8, 4]
    idx, cutoff = route_topk_with_cutoff(scores, torch.zeros(4), top_k=1)
    torch.testing.assert_close(cutoff, torch.tensor([0.69, 0.51, 0.57, 0.61, 0.61, 0.25, 0.55, 0.73]))
    assert idx.squeeze(1).tolist() == [0, 0, 2, 1, 1, 1, 0, 0]
    assert expert_loads(idx, 4).tolist() == [4, 3, 1, 0]

    bias = qb_exact(scores, cutoff, top_k=1)
    torch.testing.assert_close(bias, torch.tensor([-0.04, -0.04, 0.05, 0.03]), atol=1e-6, rtol=0)
    idx, _ = route_topk_with_cutoff(scores, bias, top_k=1)
    assert idx.squeeze(1).tolist() == [3, 2, 2, 1, 1, 3, 0, 0]
    assert expert_loads(idx, 4).tolist() == [2, 2, 2, 2]

    hist_bias, _ = histogram_bias(torch.zeros(4), scores, cutoff, top_k=1)
    idx, _ = route_topk_with_cutoff(scores, hist_bias, top_k=1)
    assert idx.squeeze(1).tolist() == [3, 2, 2, 1, 1, 3, 0, 0]


# 4096·4/64 = 256 is an integer q; 4093 gives q = 255.8125
@pytest.mark.parametrize("m", [4096, 4093])
@pytest.mark.parametrize("bias_scale", [0.0, 0.3])
def test_histogram_matches_exact(m, bias_scale):
    num_experts, top_k = 64, 4
    scores = skewed_scores(m, num_experts, seed=1)
    bias = bias_scale * torch.randn(num_experts, generator=torch.Generator().manual_seed(2))
    _, cutoff = route_topk_with_cutoff(scores, bias, top_k)

    hist_bias, hist = histogram_bias(bias, scores, cutoff, top_k, center=False)
    exact_bias = qb_exact(scores, cutoff, top_k, center=False)
    w = hist.bin_width
    assert (hist_bias - exact_bias).abs().max() <= w + 1e-6
    # centring subtracts two means that differ by at most w
    assert (hist.bias(top_k) - qb_exact(scores, cutoff, top_k)).abs().max() <= 2 * w + 1e-6
    # the token count read back by the caller (train_step) gives the same bias, bit for bit
    assert torch.equal(hist.bias(top_k, num_tokens=hist.num_tokens), hist.bias(top_k))


def test_sharding_invariance():
    m, num_experts, top_k = 1000, 32, 4
    scores = skewed_scores(m, num_experts, seed=3)
    bias = 0.2 * torch.randn(num_experts, generator=torch.Generator().manual_seed(4))
    _, cutoff = route_topk_with_cutoff(scores, bias, top_k)
    ref_bias, ref = histogram_bias(bias, scores, cutoff, top_k)

    for num_ranks in (1, 2, 4):
        for micro_batches in (1, 3):
            hists = [QuantileHistogram(bias) for _ in range(num_ranks)]
            # uneven shards; each micro-batch routes on its own, as in training
            for hist, shard in zip(hists, torch.tensor_split(scores, num_ranks)):
                for micro in torch.tensor_split(shard, micro_batches):
                    _, micro_cutoff = route_topk_with_cutoff(micro, bias, top_k)
                    hist.add(micro, micro_cutoff)
            # what an all-reduce (SUM) of state_tensors() leaves on every rank
            for tensors in zip(*(h.state_tensors() for h in hists)):
                total = torch.stack(tensors).sum(0)
                for t in tensors:
                    t.copy_(total)
            for hist in hists:
                assert torch.equal(hist.counts, ref.counts)
                assert hist.num_tokens == m
                assert torch.equal(hist.bias(top_k), ref_bias)


@pytest.mark.parametrize("estimator", ["exact", "histogram"])
def test_convergence(estimator):
    m, num_experts, top_k = 4096, 64, 4
    g = torch.Generator().manual_seed(5)
    # a few experts strongly favoured, decaying over the rest
    offset = 4.0 * torch.exp(-torch.arange(num_experts) / 4.0)
    scores = torch.sigmoid(torch.randn(m, num_experts, generator=g) + offset)  # fixed across steps
    bias = torch.zeros(num_experts)
    ratios = []
    for _ in range(6):
        idx, cutoff = route_topk_with_cutoff(scores, bias, top_k)
        ratios.append(imbalance_metrics(expert_loads(idx, num_experts))["max_over_mean"])
        if estimator == "exact":
            bias = qb_exact(scores, cutoff, top_k)
        else:
            bias, _ = histogram_bias(bias, scores, cutoff, top_k)
    assert ratios[0] > 10, ratios
    assert ratios[5] <= 1.2, ratios


@pytest.mark.parametrize("m, ties", [(512, False), (509, False), (512, True)])
def test_exact_update_brackets_q(m, ties):
    num_experts, top_k = 16, 2
    scores = skewed_scores(m, num_experts, seed=6)
    if ties:
        scores = (scores * 20).round() / 20
    bias = 0.1 * torch.randn(num_experts, generator=torch.Generator().manual_seed(7))
    _, cutoff = route_topk_with_cutoff(scores, bias, top_k)
    new_bias = qb_exact(scores, cutoff, top_k, center=False)

    # s + b > α  <=>  r < b, with r computed exactly as the rule does
    r = required_bias(scores, cutoff)  # [N, E]
    q = m * top_k / num_experts
    assert ((r < new_bias).sum(0) <= q).all()
    assert ((r <= new_bias).sum(0) > q).all()


def test_token_mask_excludes_padding():
    m, pad, num_experts, top_k = 300, 77, 16, 2
    scores = skewed_scores(m, num_experts, seed=8)
    # padding rows that would pull every quantile if counted
    padding = torch.zeros(pad, num_experts)
    padding[:, 0] = 0.99
    padded = torch.cat([scores[:100], padding, scores[100:]])
    mask = torch.ones(m + pad, dtype=torch.bool)
    mask[100 : 100 + pad] = False
    bias = 0.1 * torch.randn(num_experts, generator=torch.Generator().manual_seed(9))

    _, cutoff = route_topk_with_cutoff(scores, bias, top_k)
    idx_padded, cutoff_padded = route_topk_with_cutoff(padded, bias, top_k)

    assert torch.equal(
        qb_exact(padded, cutoff_padded, top_k, token_mask=mask), qb_exact(scores, cutoff, top_k)
    )
    hist_padded, h_padded = histogram_bias(bias, padded, cutoff_padded, top_k, token_mask=mask)
    hist_clean, h_clean = histogram_bias(bias, scores, cutoff, top_k)
    assert h_padded.num_tokens == m
    assert torch.equal(h_padded.counts, h_clean.counts)
    assert torch.equal(hist_padded, hist_clean)
    assert expert_loads(idx_padded, num_experts, token_mask=mask).sum() == m * top_k


def test_imbalance_metrics():
    metrics = imbalance_metrics(torch.tensor([4, 3, 1, 0]))
    assert metrics == {"max_over_mean": 2.0, "max_vio": 1.0}
    loads = torch.randint(0, 50, (5, 16))
    per_layer = imbalance_from_stats(*layer_load_stats(loads).tolist())
    for i, row in enumerate(loads.tolist()):  # each layer's numbers, exactly
        ratio = max(row) / (sum(row) / len(row))
        assert per_layer["max_over_mean"][i] == pytest.approx(ratio, rel=1e-15)
        assert per_layer["max_vio"][i] == pytest.approx(ratio - 1.0, rel=1e-15, abs=1e-15)
    with pytest.raises(ValueError, match="all zero"):
        imbalance_from_stats(*layer_load_stats(torch.tensor([[1, 2], [0, 0]])).tolist())


def test_bad_input_raises():
    scores = torch.rand(8, 4)
    cutoff = torch.rand(8)
    bias = torch.zeros(4)
    with pytest.raises(ValueError):
        route_topk_with_cutoff(scores, bias, top_k=4)  # E == k
    with pytest.raises(ValueError):
        route_topk_with_cutoff(scores, bias, top_k=5)  # E < k
    with pytest.raises(ValueError):
        route_topk_with_cutoff(scores, torch.zeros(5), top_k=1)  # bias length
    with pytest.raises(ValueError):
        route_topk_with_cutoff(scores[0], bias, top_k=1)  # not [N, E]
    with pytest.raises(ValueError):
        required_bias(scores, torch.rand(7))
    with pytest.raises(ValueError):
        qb_exact(scores, cutoff, top_k=4)  # E == k
    with pytest.raises(ValueError):
        qb_exact(scores, torch.rand(7), top_k=1)  # cutoff length
    with pytest.raises(ValueError):
        qb_exact(scores, cutoff, top_k=1, token_mask=torch.ones(7, dtype=torch.bool))
    with pytest.raises(ValueError):
        qb_exact(scores, cutoff, top_k=1, token_mask=torch.zeros(8, dtype=torch.bool))  # no tokens
    hist = QuantileHistogram(bias)
    with pytest.raises(ValueError):
        hist.add(torch.rand(8, 5), cutoff)  # expert count
    with pytest.raises(ValueError):
        hist.add(scores, torch.rand(7))
    with pytest.raises(ValueError):
        hist.add(scores, cutoff, token_mask=torch.ones(8))  # not bool
    with pytest.raises(ValueError):
        hist.bias(top_k=1)  # nothing counted
    hist.add(scores, cutoff)
    with pytest.raises(ValueError):
        hist.bias(top_k=4)  # E == k
    with pytest.raises(ValueError):
        QuantileHistogram(torch.zeros(2, 2))


def test_expert_loads_counts_int32_and_int64_ids():
    """Counted by a scatter-add (no host sync on CUDA, unlike bincount), for either index dtype."""
    from k3.model.quantile_balancing import expert_loads

    for dtype in (torch.int32, torch.int64):
        ids = torch.tensor([[0, 3], [3, 1], [3, 0]], dtype=dtype)
        assert expert_loads(ids, 5).tolist() == [2, 1, 0, 3, 0]
