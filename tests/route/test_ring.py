"""The router's pure pieces: the consistent-hash ring, the conversation key and the admission budgets."""

from __future__ import annotations

import pytest

from k3.route.admission import Admission, ClassBudget, estimate_tokens
from k3.route.ring import Ring, affinity_key

KEYS = [f"conversation-{i}" for i in range(6000)]
URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_adding_a_replica_moves_about_one_in_n_plus_one_keys_all_to_it(n):
    ring = Ring(URLS[:n])
    before = {k: ring.primary(k) for k in KEYS}
    ring.add(URLS[n])
    moved = [k for k in KEYS if ring.primary(k) != before[k]]
    assert all(ring.primary(k) == URLS[n] for k in moved)  # nothing moves between the old replicas
    share = len(moved) / len(KEYS)
    assert abs(share - 1 / (n + 1)) < 0.06, share
    # the keys spread over the replicas within a few tens of percent of even
    counts = [sum(ring.primary(k) == u for k in KEYS) for u in URLS[: n + 1]]
    assert max(counts) / min(counts) < 1.35, counts


def test_secondary_is_where_the_key_goes_when_its_primary_leaves():
    ring = Ring(URLS[:4])
    for key in KEYS[:1000]:
        owners = ring.owners(key)
        assert sorted(owners) == sorted(URLS[:4]) and owners[0] == ring.primary(key)
        without = Ring([u for u in URLS[:4] if u != owners[0]])
        assert without.primary(key) == owners[1]


def test_ring_refuses_bad_replica_lists():
    with pytest.raises(ValueError):
        Ring([])
    with pytest.raises(ValueError):
        Ring([URLS[0], URLS[0]])
    with pytest.raises(ValueError):
        Ring(URLS[:2]).add(URLS[0])


def test_a_conversation_keeps_its_key_across_turns():
    system = {"role": "system", "content": "You are terse."}
    turn1 = [system, {"role": "user", "content": "hello"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "and then?"}]
    path = "/v1/chat/completions"
    key = affinity_key(path, {"messages": turn1}, {})
    assert key == affinity_key(path, {"messages": turn2, "temperature": 0.3}, {})
    assert key != affinity_key(path, {"messages": [system, {"role": "user", "content": "bye"}]}, {})
    assert key != affinity_key(path, {"messages": turn1, "tools": [{"type": "function"}]}, {})
    # an explicit session wins: the header first, then prompt_cache_key
    assert affinity_key(path, {"messages": turn1, "prompt_cache_key": "c"}, {"x-session-id": "s"}) == "session:s"
    assert affinity_key(path, {"messages": turn1, "prompt_cache_key": "c"}, {}) == "cache:c"
    # completions: the first characters of the prompt
    long = "x" * 300
    assert affinity_key("/v1/completions", {"prompt": long}, {}) == affinity_key(
        "/v1/completions", {"prompt": long + " more"}, {})
    assert affinity_key("/v1/completions", {"prompt": [[1, 2, 3]]}, {}).startswith("ids:")
    assert affinity_key("/v1/responses", {"input": "hi", "instructions": "be brief"}, {}).startswith("resp:")
    assert affinity_key("/v1/models", None, {}) is None


def test_admission_budgets_per_class():
    admission = Admission({"short": ClassBudget(tokens=100, requests=2), "long": ClassBudget(tokens=1000, requests=1)},
                          long_threshold=200)
    assert admission.request_class(150) == "short" and admission.request_class(201) == "long"
    assert admission.admit("short", 60) is None
    assert "token budget" in admission.admit("short", 60)  # 120 > 100
    assert admission.admit("short", 40) is None
    assert "in flight" in admission.admit("short", 1)  # the request cap
    assert admission.admit("long", 5000) is None  # larger than the budget: alone, when the class is idle
    assert admission.admit("long", 300) is not None
    admission.release("long", 5000)
    admission.release("short", 60)
    assert admission.admit("short", 60) is None
    assert admission.rejected == {"short": 2, "long": 1}


def test_estimate_counts_body_and_completion_budget():
    assert estimate_tokens(400, {"max_tokens": 10, "n": 3}, 4.0, 4096) == 100 + 30
    assert estimate_tokens(400, {"max_completion_tokens": 7}, 4.0, 4096) == 107
    assert estimate_tokens(400, None, 4.0, 4096) == 100 + 4096
