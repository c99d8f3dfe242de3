"""The token budget: T counted on real reply tokens, the override at exactly ⌊τ·b0⌋ + 1 tokens, the τ curriculum."""

import pytest

from k3.chat.template import ChatTemplate
from k3.posttrain.budget import (TauCurriculum, budget_limit, budgeted_reward, over_budget,
                                 thinking_tokens)


def _reply(template: ChatTemplate, think_len: int, answer: str = "The answer is 8.") -> tuple[list[int], int]:
    """Reply ids after the thinking generation prompt whose think content is `think_len` tokens; and its T (the content
    plus the closing tag)."""
    word = template.tokenizer.encode("the")[:1]  # any one ordinary token
    close = template.close_tag("think")
    ids = word * think_len + close + template.open_tag("response") + template.text(answer)
    ids += template.close_tag("response") + [template.end_id]
    return ids, think_len + len(close)


def test_thinking_tokens_counts_the_think_channel(tokenizer):
    template = ChatTemplate(tokenizer)
    for n in (0, 1, 17):
        ids, expected = _reply(template, n)
        assert thinking_tokens(tokenizer, ids) == expected
    # a reply cut off inside its thinking: every token is thinking
    ids, _ = _reply(template, 9)
    assert thinking_tokens(tokenizer, ids[:7]) == 7


@pytest.mark.parametrize("b0, tau", [(20, 1.5), (10, 1.1), (100, 0.57), (13, 0.7), (37.5, 2.0)])
def test_override_fires_at_exactly_tau_b0_plus_one(tokenizer, b0, tau):
    """Integer τ·b0 (30, 75) fires at τ·b0 + 1; floating-point products just above or below an integer (11.000…02,
    56.999…99) are taken as that integer; a fractional τ·b0 (9.1) fires at its floor + 1."""
    exact = {(20, 1.5): 30, (10, 1.1): 11, (100, 0.57): 57, (13, 0.7): 9, (37.5, 2.0): 75}[(b0, tau)]
    assert budget_limit(b0, tau) == exact
    template = ChatTemplate(tokenizer)
    close = len(template.close_tag("think"))
    within, _ = _reply(template, exact - close)
    over, _ = _reply(template, exact - close + 1)
    assert thinking_tokens(tokenizer, within) == exact
    assert not over_budget(thinking_tokens(tokenizer, within), b0, tau, truncated=False)
    assert over_budget(thinking_tokens(tokenizer, over), b0, tau, truncated=False)
    assert budgeted_reward(1.0, over_budget(exact, b0, tau, False)) == 1.0
    assert budgeted_reward(1.0, over_budget(exact + 1, b0, tau, False)) == -1.0


def test_hitting_max_tokens_is_over_budget_and_rewards():
    assert over_budget(1, 100.0, 2.0, truncated=True)
    assert budgeted_reward(1.0, True) == -1.0 and budgeted_reward(0.0, True) == -1.0
    assert budgeted_reward(0.0, False) == 0.0 and budgeted_reward(0.5, False) == 0.5
    with pytest.raises(ValueError):
        budget_limit(0.0, 1.0)


def test_curriculum_max_first_then_anneal():
    cur = TauCurriculum(max_first_iterations=4, anneal_iterations=10, tau_cap=3.0,
                        tau_final={"low": 0.5, "high": 1.0, "max": 2.0})
    cur.validate(["low", "high", "max"])
    for it in range(4):
        assert cur.efforts(it, ["low", "high", "max"]) == ["max"]
        assert cur.tau("max", it) == 3.0
    assert cur.efforts(4, ["low", "high", "max"]) == ["low", "high", "max"]
    assert cur.tau("low", 4) == 3.0 and cur.tau("low", 9) == pytest.approx(1.75) and cur.tau("low", 14) == 0.5
    assert cur.tau("high", 100) == 1.0 and cur.tau("max", 100) == 2.0
    # without max among the efforts, there is no max-only phase
    assert cur.efforts(0, ["low", "high"]) == ["low", "high"]
    with pytest.raises(ValueError, match="above tau_cap"):
        TauCurriculum(tau_cap=1.0).validate(["max"])
    with pytest.raises(ValueError, match="unknown effort"):
        TauCurriculum().validate(["medium"])
