"""A plain sampling loop over the model's decoding cache: prefill once, then one token per step.

Legend: B sequences, T prompt tokens, V vocabulary.
This is the simple reference generator; the batched inference engine builds on the same cache semantics.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from k3.model.model import K3ForCausalLM


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> next token ids [B]. temperature 0 is greedy."""
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        # drop a token once the mass before it already reaches top_p (the first token always stays)
        drop = (cum - torch.softmax(sorted_logits, -1)) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: K3ForCausalLM, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.8,
             top_k: int | None = 50, top_p: float | None = 0.95, stop_ids: set[int] | None = None,
             seed: int = 0) -> Iterator[int]:
    """Yield up to `max_new_tokens` sampled token ids after `prompt_ids`, stopping at any of `stop_ids`."""
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = model.new_cache(1)
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache).logits[:, -1]
    for _ in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, top_p, generator)
        token_id = int(token)
        if stop_ids and token_id in stop_ids:
            return
        yield token_id
        logits = model(token.view(1, 1), cache=cache).logits[:, -1]
