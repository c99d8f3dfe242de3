"""Budget-based admission per request class, before a request reaches any replica.

A request's size is estimated without a tokenizer: its body's bytes over `bytes_per_token`, plus the completion
budget it asks for (`max_tokens` / `max_completion_tokens` / `max_output_tokens`, else the default) times `n`.
Over `long_threshold` it is a long request, else a short one. Each class has a token budget (the sum of the
estimates of its requests in flight) and a request cap; a request that would pass either is refused at once
(429 with Retry-After) rather than queued, so a burst of long prompts cannot starve the short, interactive ones.
A request larger than its class's whole budget runs alone when its class is idle (the estimate is rough, so it
is not refused as impossible).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

CLASSES = ("short", "long")


@dataclass
class ClassBudget:
    """The limits of one request class."""

    tokens: int
    requests: int


def estimate_tokens(body_bytes: int, body: Any, bytes_per_token: float, default_max_tokens: int) -> int:
    """Prompt estimate (body bytes / bytes_per_token) + completion budget × n."""
    completion, n = default_max_tokens, 1
    if isinstance(body, dict):
        for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
            if isinstance(body.get(name), int) and not isinstance(body.get(name), bool):
                completion = body[name]
                break
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 0:
            n = body["n"]
    return math.ceil(body_bytes / bytes_per_token) + max(0, completion) * n


class Admission:
    """Tokens and requests in flight per class; `admit` takes a share, `release` gives it back."""

    def __init__(self, budgets: dict[str, ClassBudget], long_threshold: int):
        assert set(budgets) == set(CLASSES), budgets
        for name, b in budgets.items():
            if b.tokens < 1 or b.requests < 1:
                raise ValueError(f"the {name} class needs a positive token budget and request cap, got {b}")
        self.budgets, self.long_threshold = budgets, long_threshold
        self.tokens = dict.fromkeys(CLASSES, 0)
        self.requests = dict.fromkeys(CLASSES, 0)
        self.rejected = dict.fromkeys(CLASSES, 0)

    def request_class(self, estimate: int) -> str:
        return "long" if estimate > self.long_threshold else "short"

    def admit(self, cls: str, estimate: int) -> str | None:
        """Take `estimate` tokens of `cls`'s budget; None when admitted, else why not (the 429's message)."""
        budget = self.budgets[cls]
        if self.requests[cls] >= budget.requests:
            why = f"{self.requests[cls]} {cls} requests are in flight, the most the router admits"
        elif self.requests[cls] and self.tokens[cls] + estimate > budget.tokens:
            why = (f"the {cls} class's token budget is spent: {self.tokens[cls]} of {budget.tokens} tokens in "
                   f"flight, this request needs about {estimate}")
        else:
            self.tokens[cls] += estimate
            self.requests[cls] += 1
            return None
        self.rejected[cls] += 1
        return why

    def release(self, cls: str, estimate: int) -> None:
        self.tokens[cls] -= estimate
        self.requests[cls] -= 1
        assert self.tokens[cls] >= 0 and self.requests[cls] >= 0, (self.tokens, self.requests)
