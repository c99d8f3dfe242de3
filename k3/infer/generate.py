"""A plain decoding loop over the model's own cache: prefill once, then one token per step.

Legend: B sequences, V vocabulary.
This is the engine-free reference (the tests compare the engine's output with it) and the decode loop of
the transformers wrapper. Token choice is the engine's sampler (`k3.infer.sampling.sample`), so there is
one implementation of temperature / top-k / top-p / min-p / penalties.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from k3.infer.api import SamplingParams
from k3.infer.sampling import sample
from k3.model.model import K3ForCausalLM


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """logits [B, V] -> next token ids [B], every row with the same parameters and generator."""
    tokens, _ = sample(logits, [params] * logits.shape[0], [generator] * logits.shape[0])
    return torch.tensor(tokens, device=logits.device)


@torch.no_grad()
def generate(model: K3ForCausalLM, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.8,
             top_k: int | None = 50, top_p: float | None = 0.95, stop_ids: set[int] | None = None,
             seed: int = 0) -> Iterator[int]:
    """Yield up to `max_new_tokens` sampled token ids after `prompt_ids`, stopping at any of `stop_ids`."""
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k or 0,
                            top_p=top_p if top_p is not None else 1.0)
    params.validate(model.config.vocab_size)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = model.new_cache(1)
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache).logits[:, -1]
    for _ in range(max_new_tokens):
        token = sample_next(logits, params, generator)
        token_id = int(token)
        if stop_ids and token_id in stop_ids:
            return
        yield token_id
        logits = model(token.view(1, 1), cache=cache).logits[:, -1]
