"""One request inside the engine: its tokens, how many are in the cache, its pages, its sampling state.

States (docs/inference.md): WAITING → RUNNING → FINISHED. (The spec's WAITING_FOR_KV, waiting for a CPU-pool
load to land, is not a separate state here: loads are synchronous copies made while admitting.)
A preempted request frees its pages (its registered prefix stays in the prefix cache), goes back to the
front of the waiting queue with `num_computed = 0` and is recomputed — prompt plus the tokens it already
generated — when readmitted; its sampling generator is kept, so sampled output continues unchanged.

`tokens` = prompt + generated. The cache holds `tokens[:num_computed]`; each step runs the next piece
`tokens[num_computed : num_computed + n]`, and when the piece reaches the end of `tokens` the logits of
its last position sample the next token. Prefill, decode and recompute after preemption are one path.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from k3.infer.api import SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    long: bool = False  # admission class (docs/inference.md)
    arrival: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    # cache: one MLABlock per page of tokens (each holds one page per MLA layer), and the private KDA
    # state pages (one per KDA layer) while running
    blocks: list = field(default_factory=list)
    kda_pages: list[int] | None = None
    hashes: list[bytes] = field(default_factory=list)  # chained hash of every complete hash block of tokens
    num_registered: int = 0  # hash blocks whose endpoints were offered to the prefix cache
    decode_checkpoint: object | None = None  # the latest decode-time KDA checkpoint (recycled when superseded)
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    admitted_once: bool = False
    num_preemptions: int = 0
    # outputs
    output_ids: list[int] = field(default_factory=list)
    emitted_tokens: int = 0  # output tokens already returned in a RequestOutput
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    admit_time: float | None = None
    # the grammar's matcher (`SamplingParams.grammar`), advanced on every accepted output token; recompute after
    # preemption replays cached work only, never sampling, so it stays in step with `output_ids`
    matcher: object | None = None
    # speculative decoding: the tokens drafted for the next verify, the draft's processed distributions they were
    # drawn from ([k, V] float64), and the drafted tokens the target accepted / rejected so far
    draft_tokens: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    accepted_tokens: int = 0
    rejected_tokens: int = 0

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)
        if self.matcher is None and self.sampling.grammar is not None:
            self.matcher = self.sampling.grammar.matcher()

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def budget_tokens(self) -> int:
        """What admission charges: the worst case prompt + max_tokens."""
        return len(self.prompt_ids) + self.sampling.max_tokens

    @property
    def remaining(self) -> int:
        """Tokens not yet in the cache."""
        return len(self.tokens) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
