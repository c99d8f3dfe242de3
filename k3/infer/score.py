"""Teacher-forced log-probabilities of given token ids: the prompt side of the completions API's `echo` with
`logprobs`, and the log-likelihoods evaluation sums (docs/evaluation.md).

Legend: N prompts, T tokens of one prompt, V vocabulary, k alternatives.

Entry t ≥ 1 of a prompt is log p(ids[t] | ids[:t]) under the model's raw distribution (log-softmax of the
unprocessed logits in fp32, as the engine reports generated tokens); entry 0 has no context and is None, as
in OpenAI's echo. Short prompts are packed into one forward (documents never see each other, `cu_seqlens`);
a prompt longer than the per-forward budget runs in pieces over the model's own cache, so the [T, V] logits
never exist at once. The budget is in logit bytes (`max_logit_bytes`): K3's 163,840-token vocabulary makes
the head, not the layers, what bounds a forward.

The generation loop is not involved: `PromptScorer` runs the engine's model directly. Given the engine
(`scorer_for`), it takes the engine's lock for each forward, so a scoring forward never overlaps an engine
step (which may be capturing or replaying CUDA graphs) and long prompts interleave with decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from typing import Any

import torch

from k3.infer.api import TokenLogprob
from k3.model.model import K3ForCausalLM

MAX_LOGIT_BYTES = 2**30  # fp32 logits of one forward: 1 GiB is 1,638 tokens of K3's vocabulary
# tokens of one forward whatever the vocabulary: off CUDA the reference attention holds [H, T, T] scores of the
# whole packed forward, so a small-vocabulary model must not pack its budget of logits (32K tokens at 8K words)
MAX_FORWARD_TOKENS = 4096


@dataclass
class PromptScores:
    """One prompt's scores. `logprobs` [T] fp32 (entry 0 NaN: no context); `top_ids` / `top_logprobs` [T, k]
    (row 0 unused), the k most likely tokens at each position, best first."""

    ids: list[int]
    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def total(self, start: int = 1, end: int | None = None) -> float:
        """Σ log p over positions [start, end): the log-likelihood of ids[start:end] given ids[:start]."""
        if start < 1:
            raise ValueError("position 0 has no context; start at 1 or later")
        return float(self.logprobs[start:end].double().sum())

    def greedy(self, start: int = 1, end: int | None = None) -> bool:
        """Every token in [start, end) is the model's argmax there (ties count as greedy)."""
        lp = self.logprobs[start:end]
        best = self.top_logprobs[start:end, 0] if self.top_logprobs.shape[1] else lp
        return bool((lp >= best).all())

    def token_logprobs(self) -> list[TokenLogprob | None]:
        """The engine's per-token form: None at position 0, then (token, logprob, top-k alternatives)."""
        out: list[TokenLogprob | None] = [None]
        lps, top_ids, top_lps = self.logprobs.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
        for t in range(1, len(self.ids)):
            out.append(TokenLogprob(self.ids[t], lps[t], list(zip(top_ids[t], top_lps[t]))))
        return out


def _positions_scores(logits: torch.Tensor, targets: torch.Tensor, top: int) -> tuple[torch.Tensor, ...]:
    """logits [n, V] predicting targets [n] -> (logprob [n], top ids [n, k], top logprobs [n, k]) fp32 on CPU."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    lp = logp.gather(1, targets[:, None]).squeeze(1)
    if top > 0:
        vals, ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
    else:
        vals = logp.new_empty(len(targets), 0)
        ids = torch.empty(len(targets), 0, dtype=torch.long, device=logp.device)
    return lp.cpu(), ids.cpu(), vals.cpu()


class PromptScorer:
    """Scores prompts with a model: `score(prompts, top)` -> one `PromptScores` per prompt, in order.

    `lock`: held around each forward (the engine's, so scoring and engine steps take turns); `max_logit_bytes`:
    the fp32 logits one forward may produce (tokens per forward = max_logit_bytes / (4 V), at least 1, at most
    `max_forward_tokens`).
    """

    def __init__(self, model: K3ForCausalLM, lock: Any = None, max_logit_bytes: int = MAX_LOGIT_BYTES,
                 max_forward_tokens: int = MAX_FORWARD_TOKENS):
        self.model = model
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.device = next(model.parameters()).device
        vocab = model.config.vocab_size
        self.tokens_per_forward = max(1, min(max_forward_tokens, max_logit_bytes // (4 * vocab)))
        self._serial = threading.Lock()  # one scoring call at a time (they would only split the device)

    def score(self, prompts: list[list[int]], top: int = 0) -> list[PromptScores]:
        """prompts: token id lists (any lengths); top: alternatives kept per position. ValueError on bad input."""
        vocab = self.model.config.vocab_size
        for i, ids in enumerate(prompts):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
                raise ValueError(f"prompt {i}: token ids must be ints in [0, {vocab})")
        if top < 0:
            raise ValueError(f"top must be >= 0, got {top}")
        out: list[PromptScores | None] = [None] * len(prompts)
        with self._serial:
            pack: list[int] = []
            packed = 0  # tokens in `pack`
            for i in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):
                if len(prompts[i]) > self.tokens_per_forward:
                    out[i] = self._score_long(prompts[i], top)
                    continue
                if packed + len(prompts[i]) > self.tokens_per_forward:
                    self._score_packed(prompts, pack, top, out)
                    pack, packed = [], 0
                pack.append(i)
                packed += len(prompts[i])
            if pack:
                self._score_packed(prompts, pack, top, out)
        return out  # type: ignore[return-value]

    async def ascore(self, prompts: list[list[int]], top: int = 0) -> list[PromptScores]:
        """`score` in a worker thread, for the event loop."""
        return await asyncio.to_thread(self.score, prompts, top)

    def _forward(self, ids: list[int], cu_seqlens: list[int] | None = None, cache=None) -> torch.Tensor:
        with self.lock, torch.inference_mode():
            x = torch.tensor([ids], dtype=torch.long)
            cu = torch.tensor(cu_seqlens, device=self.device) if cu_seqlens else None
            return self.model(x, cu_seqlens=cu, cache=cache).logits[0]  # [n, V]

    def _score_packed(self, prompts: list[list[int]], which: list[int], top: int, out: list) -> None:
        """Short prompts as the documents of one packed forward."""
        ids, cu = [], [0]
        for i in which:
            ids += prompts[i]
            cu.append(len(ids))
        logits = self._forward(ids, cu)
        for n, i in enumerate(which):
            a, b = cu[n], cu[n + 1]
            targets = torch.tensor(prompts[i][1:], dtype=torch.long, device=logits.device)
            out[i] = self._assemble(prompts[i], *_positions_scores(logits[a : b - 1], targets, top))

    def _score_long(self, ids: list[int], top: int) -> PromptScores:
        """One long prompt in pieces over the model's cache: the piece at positions [a, b) predicts ids[a+1 : b+1]
        (the last piece one token fewer)."""
        cache = self.model.new_cache(1)
        step = self.tokens_per_forward
        parts = []
        for a in range(0, len(ids), step):
            logits = self._forward(ids[a : a + step], cache=cache)
            targets = torch.tensor(ids[a + 1 : a + step + 1], dtype=torch.long, device=logits.device)
            parts.append(_positions_scores(logits[: len(targets)], targets, top))
        lp, top_ids, top_lps = (torch.cat(p) for p in zip(*parts))
        return self._assemble(ids, lp, top_ids, top_lps)

    @staticmethod
    def _assemble(ids: list[int], lp: torch.Tensor, top_ids: torch.Tensor, top_lps: torch.Tensor) -> PromptScores:
        """Per-position scores of ids[1:] -> the [T] layout with position 0 first (NaN, no context)."""
        k = top_ids.shape[1]
        return PromptScores(
            ids=list(ids),
            logprobs=torch.cat([torch.full((1,), float("nan")), lp.float()]),
            top_ids=torch.cat([torch.zeros(1, k, dtype=torch.long), top_ids]),
            top_logprobs=torch.cat([torch.full((1, k), float("nan")), top_lps.float()]),
        )


def scorer_for(engine: Any, max_logit_bytes: int = MAX_LOGIT_BYTES) -> PromptScorer | None:
    """The scorer over an `Engine`'s or `AsyncEngine`'s model, sharing the async engine's lock; None for
    anything else (a test double without a model)."""
    inner = getattr(engine, "engine", engine)
    model = getattr(inner, "model", None)
    if not isinstance(model, K3ForCausalLM):
        return None
    lock = getattr(engine, "_engine_lock", None)
    return PromptScorer(model, lock=lock, max_logit_bytes=max_logit_bytes)
