"""MoonEP planner properties on random, skewed and adversarial routing (docs/distributed.md)."""

import pytest
import torch

from k3.parallel.moonep import plan_moonep, plan_moonep_reference


def random_counts(gen, R, E, S, K, skew=0.0):
    """[R, E] counts of S tokens per rank routed top-K without repeats; skew > 0 gives Zipf-like popularity."""
    weights = (torch.arange(E, dtype=torch.float64) + 1) ** -skew
    weights = weights[torch.randperm(E, generator=gen)]
    counts = torch.zeros(R, E, dtype=torch.int64)
    for r in range(R):
        picks = torch.multinomial(weights.expand(S, E), K, replacement=False, generator=gen)  # [S, K]
        counts[r] = torch.bincount(picks.flatten(), minlength=E)
    return counts


def check_plan(plan, counts, S, K, exact=True):
    R, E = counts.shape
    P = E // R
    assert plan.send.shape == (R, E, R)
    assert plan.slot_experts.shape == (R, P) and plan.slot_counts.shape == (R, P)
    # Every (source, expert) pair's copies are all routed somewhere, none invented.
    assert (plan.send >= 0).all()
    assert torch.equal(plan.send.sum(2), counts)
    load = plan.send.sum((0, 1))
    assert torch.equal(load, plan.load)
    if exact:
        assert (load == S * K).all()
    else:
        assert load.max() - load.min() <= 1 and load.max() <= S * K
        assert load.sum() == counts.sum()
    home = torch.arange(E) // P
    for d in range(R):
        # Copies processed on d for a non-home expert are exactly d's slots.
        foreign = plan.send[:, :, d].sum(0)  # [E]
        foreign[home == d] = 0
        used = plan.slot_experts[d] >= 0
        assert used.sum() <= P
        assert torch.equal(plan.slot_counts[d][~used], torch.zeros_like(plan.slot_counts[d][~used]))
        expected = torch.zeros(E, dtype=torch.int64)
        expected[plan.slot_experts[d][used]] = plan.slot_counts[d][used]
        assert torch.equal(foreign, expected)
        # Slots hold distinct, non-home experts, all from a single home rank.
        experts = plan.slot_experts[d][used]
        assert len(set(experts.tolist())) == len(experts)
        if used.any():
            assert (home[experts] == plan.slot_home[d]).all() and plan.slot_home[d] != d
        else:
            assert plan.slot_home[d] == -1
    # All-to-all splits agree between sender and receiver.
    for r in range(R):
        for d in range(R):
            assert plan.send_splits(r)[d] == plan.recv_splits(d)[r]


@pytest.mark.parametrize("R,E", [(1, 4), (2, 8), (3, 9), (4, 16), (8, 64)])
@pytest.mark.parametrize("skew", [0.0, 1.2, 3.0])
def test_random_routing(R, E, skew):
    gen = torch.Generator().manual_seed(100 * R + int(10 * skew))
    S, K = 37, min(4, E)
    for _ in range(3):
        counts = random_counts(gen, R, E, S, K, skew)
        check_plan(plan_moonep(counts, S, K), counts, S, K)


@pytest.mark.parametrize("R,E", [(2, 4), (4, 8), (4, 16), (8, 64)])
def test_all_tokens_to_one_expert(R, E):
    S, K = 10, 1
    for e in (0, E - 1, E // 2 + 1):
        counts = torch.zeros(R, E, dtype=torch.int64)
        counts[:, e] = S * K
        plan = plan_moonep(counts, S, K)
        check_plan(plan, counts, S, K)
        # Every other rank hosts exactly one replica of the hot expert.
        for d in range(R):
            if d != e // (E // R):
                assert plan.slot_experts[d].tolist() == [e] + [-1] * (E // R - 1)


@pytest.mark.parametrize("R,E", [(2, 8), (4, 16), (8, 64), (8, 896 // 8)])
def test_all_tokens_to_one_rank(R, E):
    # Every rank routes only to the home experts of rank h: the fullest possible imbalance.
    P, S, K = E // R, 12, 4
    for h in (0, R - 1):
        counts = torch.zeros(R, E, dtype=torch.int64)
        counts[:, h * P : h * P + K] = S  # top-K over h's first K experts
        check_plan(plan_moonep(counts, S, K), counts, S, K)
        counts = torch.zeros(R, E, dtype=torch.int64)
        counts[:, h * P : (h + 1) * P] = S * K // P  # spread over all of h's experts (P divides S·K here)
        counts[:, h * P] += S * K - P * (S * K // P)
        check_plan(plan_moonep(counts, S, K), counts, S, K)


def test_one_rank_empty_tight_bound():
    # Rank 0's experts get nothing, the rest is uniform: rank 0 needs ⌈E(R−1)/R²⌉ slots (docs/distributed.md).
    R, E, K = 8, 64, 8
    P = E // R
    S = P * (R - 1)  # so that S·K spreads evenly over the E − P non-rank-0 experts
    counts = torch.zeros(R, E, dtype=torch.int64)
    counts[:, P:] = S * K // (E - P)
    plan = plan_moonep(counts, S, K)
    check_plan(plan, counts, S, K)
    assert (plan.slot_experts[0] >= 0).sum() == -(-E * (R - 1) // R**2)


def test_tight_bound_at_report_scale():
    # E = 896, R = 64: an idle home needs ⌈896·63/64²⌉ = 14 = E/R slots, the whole budget.
    R, E, K = 64, 896, 7
    P = E // R
    S = (E - P) // K
    counts = torch.zeros(R, E, dtype=torch.int64)
    counts[:, P:] = 1
    plan = plan_moonep(counts, S, K)
    assert (plan.load == S * K).all() and torch.equal(plan.send.sum(2), counts)
    assert (plan.slot_experts[0] >= 0).sum() == 14 == P
    assert (plan.slot_experts >= 0).sum(1).max() <= P


def test_partial_routing_balances_within_one():
    # Dropped or masked copies: fewer than S·K routed; loads differ by at most one copy.
    gen = torch.Generator().manual_seed(7)
    R, E, S, K = 4, 16, 20, 2
    for _ in range(5):
        counts = random_counts(gen, R, E, S, K, skew=2.0)
        counts[:, 3] = 0
        counts[1] = 0
        check_plan(plan_moonep(counts, S, K), counts, S, K, exact=False)


def test_deterministic():
    gen = torch.Generator().manual_seed(3)
    counts = random_counts(gen, 4, 32, 50, 6, skew=1.5)
    a, b = plan_moonep(counts, 50, 6), plan_moonep(counts.clone(), 50, 6)
    for f in ("send", "slot_experts", "slot_counts", "slot_home", "load"):
        assert torch.equal(getattr(a, f), getattr(b, f))


def test_bad_input():
    with pytest.raises(ValueError):
        plan_moonep(torch.zeros(3, 8, dtype=torch.int64), 4, 2)  # E not a multiple of R
    with pytest.raises(ValueError):
        plan_moonep(torch.full((2, 4), 5, dtype=torch.int64), 4, 2)  # more than S·K per rank
    with pytest.raises(ValueError):
        plan_moonep(torch.zeros(2, 4), 4, 2)  # float counts


@pytest.mark.parametrize("R,E,skew", [(2, 16, 0.0), (4, 64, 1.2), (8, 64, 2.0), (16, 896, 1.1)])
def test_tensor_planner_equals_the_loop_twin(R, E, skew):
    gen = torch.Generator().manual_seed(R * 1000 + E)
    S, K = 64, 4
    for _ in range(5):
        counts = random_counts(gen, R, E, S, K, skew)
        a, b = plan_moonep(counts, S, K), plan_moonep_reference(counts, S, K)
        for field in ("send", "slot_experts", "slot_counts", "slot_home", "load"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
