"""Quantile Balancing across ranks: the all-reduced histogram and bias equal the pooled single-process ones
bit for bit (scores fed directly, so no GEMM rounding enters), for 2 and 4 ranks × 3 micro-batches."""

import pytest
import torch
import torch.distributed as dist

from k3.model.quantile_balancing import QuantileHistogram, route_topk_with_cutoff
from tests.parallel.spawn import run_workers

E, K, TOKENS = 32, 4, 240


def _scores():
    g = torch.Generator().manual_seed(11)
    scores = torch.sigmoid(torch.randn(TOKENS, E, generator=g) + torch.linspace(-2, 2, E))  # skewed experts
    bias = torch.randn(E, generator=g) * 0.1
    _, cutoff = route_topk_with_cutoff(scores, bias, K)
    return scores, cutoff, bias


def _worker(rank, world):
    scores, cutoff, bias = _scores()
    hist = QuantileHistogram(bias)
    mine = torch.arange(TOKENS).chunk(world)[rank]
    for micro in mine.chunk(3):
        hist.add(scores[micro], cutoff[micro])
    dist.all_reduce(hist.counts)
    return hist.counts, hist.bias(K)


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_bias_equals_pooled(world):
    scores, cutoff, bias = _scores()
    pooled = QuantileHistogram(bias)
    pooled.add(scores, cutoff)
    want = pooled.bias(K)
    for counts, got in run_workers(_worker, world):
        assert torch.equal(counts, pooled.counts)
        assert torch.equal(got, want)
