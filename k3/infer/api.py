"""The inference engine's token-level API: what the server (and `k3 generate` / `k3 chat`) may use.

The server talks to the engine only through these types and `k3.infer.engine.Engine` /
`k3.infer.engine.AsyncEngine`; it never touches the model or the cache. Token ids in, token ids and
logprobs out: text (detokenization, stop strings) is `k3.chat.detokenize`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy. Penalties follow the OpenAI / vLLM conventions."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # same seed, same output
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob plus the top-k alternatives
    # a compiled `k3.infer.grammar.Grammar` (anything with `matcher()`): every generated token obeys it, and the
    # request finishes ("stop") when it is complete
    grammar: Any = None

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError (with the offending field name first) on out-of-range values."""
        checks = [
            ("max_tokens", self.max_tokens >= 1),
            ("temperature", 0.0 <= self.temperature <= 100.0),
            ("top_k", self.top_k >= 0),
            ("top_p", 0.0 < self.top_p <= 1.0),
            ("min_p", 0.0 <= self.min_p <= 1.0),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20),
            ("stop_token_ids", all(0 <= t < vocab_size for t in self.stop_token_ids)),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"{name}: value out of range ({getattr(self, name)!r})")


@dataclass
class MediaInput:
    """One image (or video item) of a request, preprocessed above the engine (`k3.vision.preprocess`): the tower's
    input and how many `<|media_pad|>` tokens of the prompt it fills (item k takes the next `num_tokens` pads).
    The engine caches its rows by `key` (k3/infer/media.py)."""

    pixel_values: Any  # torch.Tensor [t·h·w, 3, p, p] float32
    grid_thw: tuple[int, int, int]
    num_tokens: int
    key: bytes = b""  # content key; empty: the engine hashes the grid and the pixels


class MediaPrompt(list):
    """Prompt token ids (a list of ints) carrying the media of their `<|media_pad|>` tokens (`media`, in order).
    The engine reads `media` (`Engine.add_request`, `AsyncEngine.stream`); whatever only counts or forwards the
    tokens (the server's usage, its fan-out of choices) treats it as the list it is."""

    def __init__(self, ids, media):
        super().__init__(ids)
        self.media = list(media)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class RequestOutput:
    """What one engine step produced for one request (new tokens since the last output)."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (GPU pages or CPU pool)
    completion_tokens: int = 0
    # speculative decoding: drafted tokens the target accepted / rejected so far (the OpenAI usage fields)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class AdmissionError(RuntimeError):
    """The engine is over its budget: retry later. `status` 429 (rate) or 503 (overloaded)."""

    def __init__(self, message: str, retry_after: float, status: int = 503):
        super().__init__(message)
        self.retry_after = retry_after
        self.status = status


class ContextLengthError(ValueError):
    """prompt + max_tokens exceeds the engine's context limit."""


class RequestTooLargeError(ValueError):
    """Requests that the engine can never admit together (over a class budget even when idle): a 400, not a retry."""
