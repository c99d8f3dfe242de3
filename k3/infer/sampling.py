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
        probs, order = _filtered_sorted(x[torch.tensor(sampled, device=x.device)], [params[i] for i in sampled])
        for r, i in enumerate(sampled):
            race = torch.empty(V, device=x.device).exponential_(generator=generators[i])
            tokens[i] = order[r, torch.argmax(probs[r] / race)]
    token_list = tokens.tolist()
    logprobs = [None if p.logprobs is None else token_logprob(raw_logprobs[i], token_list[i], p.logprobs)
                for i, p in enumerate(params)]
    return token_list, logprobs


def token_logprob(row: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """A row of raw log-probabilities [V] -> the token's logprob and the top_n alternatives."""
    top = []
    if top_n > 0:
        vals, ids = torch.topk(row, min(top_n, row.shape[-1]))
        top = list(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token, float(row[token]), top)


def _filtered_sorted(x: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Penalized logits x [n, V] of sampled rows -> (probabilities after temperature, top-k, top-p and min-p, in
    descending order [n, V]; that order [n, V])."""
    V = x.shape[-1]
    temp = torch.tensor([p.temperature for p in params], device=x.device)
    z = x / temp[:, None]  # [n, V]
    z, order = torch.sort(z, dim=-1, descending=True)
    rank = torch.arange(V, device=x.device)[None, :]
    top_k = torch.tensor([p.top_k or V for p in params], device=x.device)
    z = z.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = torch.softmax(z, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=x.device)
    # drop a token once the mass before it already reaches top_p (the first token always stays)
    drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
    min_p = torch.tensor([p.min_p for p in params], device=x.device)
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    return torch.softmax(z.masked_fill(drop, float("-inf")), dim=-1), order


def target_distribution(logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
                        output_ids: list[list[int]]) -> torch.Tensor:
    """The distribution `sample` draws from, per row: logits [N, V] -> probabilities [N, V] float64 in vocabulary
    order, after penalties, temperature, top-k, top-p and min-p; a greedy row (temperature 0) is one-hot at its
    argmax. Speculative decoding's acceptance test compares two of these (k3.infer.speculative)."""
    x = apply_penalties(logits.float(), params, prompt_ids, output_ids)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    greedy = [i for i, p in enumerate(params) if p.temperature <= 0]
    if greedy:
        g = torch.tensor(greedy, device=x.device)
        out[g, x[g].argmax(dim=-1)] = 1.0
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled:
        idx = torch.tensor(sampled, device=x.device)
        probs, order = _filtered_sorted(x[idx], [params[i] for i in sampled])
        out[idx] = torch.zeros_like(probs, dtype=torch.float64).scatter(-1, order, probs.double())
    return out
