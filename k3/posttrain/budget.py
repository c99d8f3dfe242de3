"""Token budgets for RL with effort levels (K3 report §4.1.2): the over-budget override and the τ curriculum.

Effort is the natural-language `thinking-effort` option of the prompt (low, high, max), never a number the model
reads. Length is taught through the reward instead: every task x carries b0(x), the mean of T over `b0_samples`
samples of the cold-start model (`k3.posttrain.rollout.estimate_b0`, stored with the task), and a trajectory y
whose T(y) exceeds τ·b0(x), or that hit its `max_tokens`, gets reward −1 whatever the verifier said.

    T(y) = tokens of the think channel (its closing tag included)   single-turn tasks
         = every token the policy generated, over all turns          agentic (multi-turn, tool-using) tasks

The override fires at exactly ⌊τ·b0⌋ + 1 tokens (`budget_limit`: the largest T still within budget; the 1e-9
keeps τ·b0 = 30 from becoming 29.999… in floating point).

Curriculum (`TauCurriculum`): the first `max_first_iterations` iterations sample only `max` with the capped τ
`tau_cap`; after them every effort is sampled and its τ moves linearly from `tau_cap` to its own `tau_final` over
`anneal_iterations`. The report gives no τ values; the defaults are ours (docs/post-training.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from k3.chat.template import OutputParser
from k3.tokenizer import Tokenizer

EFFORTS = ("low", "high", "max")


def thinking_tokens(tokenizer: Tokenizer, reply_ids: Iterable[int]) -> int:
    """T of a single-turn reply (the ids generated after the thinking-mode generation prompt): its tokens inside the
    think channel, the closing `<|close|>think<|sep|>` included; all of them if the channel never closes."""
    parser = OutputParser(tokenizer, thinking=True)
    parser.feed(reply_ids)
    return parser.reasoning_tokens


def budget_limit(b0: float, tau: float) -> int:
    """The largest T within budget: ⌊τ·b0⌋."""
    if not (b0 > 0 and tau > 0):
        raise ValueError(f"b0 and tau must be positive, got b0={b0}, tau={tau}")
    return math.floor(tau * b0 + 1e-9)


def over_budget(budget_tokens: int, b0: float, tau: float, truncated: bool) -> bool:
    """T(y) > τ·b0(x), or the trajectory hit max_tokens (`truncated`)."""
    return truncated or budget_tokens > budget_limit(b0, tau)


def budgeted_reward(task_reward: float, over: bool) -> float:
    """The task reward, overridden with −1 when the trajectory is over budget."""
    return -1.0 if over else float(task_reward)


@dataclass
class TauCurriculum:
    """Which efforts are sampled and with which τ, per RL iteration (0-based)."""

    max_first_iterations: int = 10
    anneal_iterations: int = 30
    tau_cap: float = 2.0
    tau_final: dict[str, float] = field(default_factory=lambda: {"low": 0.5, "high": 1.0, "max": 2.0})

    def validate(self, efforts: tuple[str, ...] | list[str]) -> None:
        if self.max_first_iterations < 0 or self.anneal_iterations < 0:
            raise ValueError("max_first_iterations and anneal_iterations must be >= 0")
        if not self.tau_cap > 0:
            raise ValueError(f"tau_cap must be positive, got {self.tau_cap}")
        for effort in efforts:
            if effort not in EFFORTS:
                raise ValueError(f"unknown effort {effort!r}; the trained levels are {', '.join(EFFORTS)}")
            if effort not in self.tau_final or not self.tau_final[effort] > 0:
                raise ValueError(f"tau_final needs a positive value for effort {effort!r}")
            if self.tau_final[effort] > self.tau_cap:
                raise ValueError(f"tau_final[{effort!r}] = {self.tau_final[effort]} is above tau_cap {self.tau_cap}")

    def efforts(self, iteration: int, requested: tuple[str, ...] | list[str]) -> list[str]:
        """The efforts sampled at `iteration`: only `max` during the first phase (when `max` is requested)."""
        if iteration < self.max_first_iterations and "max" in requested:
            return ["max"]
        return list(requested)

    def tau(self, effort: str, iteration: int) -> float:
        if iteration < self.max_first_iterations:
            return self.tau_cap
        done = iteration - self.max_first_iterations
        frac = 1.0 if self.anneal_iterations == 0 else min(1.0, done / self.anneal_iterations)
        return self.tau_cap + (self.tau_final[effort] - self.tau_cap) * frac
