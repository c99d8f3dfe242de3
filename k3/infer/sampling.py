"""Batched sampling with per-request parameters and per-request generators.

Legend: N requests in the step, V vocabulary.

Order of operations per row (vLLM's): penalties on the raw logits (repetition over prompt + output,
then frequency and presence over the output) → the grammar mask (`k3.infer.grammar`: disallowed tokens
get -inf) → greedy argmax when temperature = 0 → otherwise divide by
the temperature → top-k → top-p (on the renormalized top-k distribution; the most likely token always
stays) → min-p (relative to the most likely token's probability) → draw. The draw is an exponential
race, argmax(p / E) with E ~ Exp(1) from the request's own `torch.Generator`, which samples exactly
from p. Every operation is row-wise, and greedy rows draw nothing, so a request's tokens depend only on
its own logits and seed, never on what else is in the batch.

Logprobs are those of the model's raw distribution (log-softmax of the unprocessed logits, as vLLM
reports by default), for the sampled token and the top-k alternatives.
"""

from __future__ import annotations

import torch

from k3.infer.api import SamplingParams, TokenLogprob


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
                    output_ids: list[list[int]]) -> torch.Tensor:
    """logits [N, V] fp32 -> penalized logits (a new tensor when any row has a penalty)."""
    rows = [i for i, p in enumerate(params)
            if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not rows:
        return logits
    logits = logits.clone()
    V = logits.shape[-1]
    dev = logits.device
    for i in rows:
        p = params[i]
        row = logits[i]
        out = torch.tensor(output_ids[i], dtype=torch.long, device=dev)
        counts = torch.bincount(out, minlength=V).to(row.dtype) if out.numel() else torch.zeros_like(row)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            if prompt_ids[i]:
                seen[torch.tensor(prompt_ids[i], dtype=torch.long, device=dev)] = True
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, penalized, row)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
        logits[i] = row
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           prompt_ids: list[list[int]] | None = None, output_ids: list[list[int]] | None = None,
           allowed: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [N, V] (any float dtype) -> (next token per row, logprobs per row or None).

    `allowed`: bool [N, V] on the logits' device, the grammar mask (every row must allow a token); the
    logprobs stay those of the unmasked distribution."""
    N, V = logits.shape
    logits = logits.float()
    prompt_ids = prompt_ids or [[] for _ in range(N)]
    output_ids = output_ids or [[] for _ in range(N)]
    raw_logprobs = None
    if any(p.logprobs is not None for p in params):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    x = apply_penalties(logits, params, prompt_ids, output_ids)
    if allowed is not None:
        x = x.masked_fill(~allowed, float("-inf"))
    tokens = x.argmax(dim=-1)  # greedy rows keep this
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled:
        idx = torch.tensor(sampled, device=x.device)
        temp = torch.tensor([params[i].temperature for i in sampled], device=x.device)
        z = x[idx] / temp[:, None]  # [n, V]
        z, order = torch.sort(z, dim=-1, descending=True)
        rank = torch.arange(V, device=x.device)[None, :]
        top_k = torch.tensor([params[i].top_k or V for i in sampled], device=x.device)
        z = z.masked_fill(rank >= top_k[:, None], float("-inf"))
        probs = torch.softmax(z, dim=-1)
        top_p = torch.tensor([params[i].top_p for i in sampled], device=x.device)
        # drop a token once the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        min_p = torch.tensor([params[i].min_p for i in sampled], device=x.device)
        drop |= probs < min_p[:, None] * probs[:, :1]
        drop[:, 0] = False
        probs = torch.softmax(z.masked_fill(drop, float("-inf")), dim=-1)
        for r, i in enumerate(sampled):
            race = torch.empty(V, device=x.device).exponential_(generator=generators[i])
            tokens[i] = order[r, torch.argmax(probs[r] / race)]
    token_list = tokens.tolist()
    logprobs: list[TokenLogprob | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            logprobs.append(None)
            continue
        row = raw_logprobs[i]
        top = []
        if p.logprobs > 0:
            vals, ids = torch.topk(row, min(p.logprobs, V))
            top = list(zip(ids.tolist(), vals.tolist()))
        logprobs.append(TokenLogprob(token_list[i], float(row[token_list[i]]), top))
    return token_list, logprobs
