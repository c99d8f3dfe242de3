"""The plain generation loop over the model's own cache: prefill once, then one token per step, batched.

Legend: B sequences, T prompt tokens, V vocabulary.
This is the engine-free reference (tests compare the engine and the server with it), the decode loop of
the transformers wrapper (`k3.hf`) and of the server tests' fake engine. Token choice is the engine's
sampler (`k3.infer.sampling.sample`, penalties included), so there is one implementation of temperature /
top-k / top-p / min-p / penalties. Prompts in a batch have equal length: a KDA state cannot skip pad tokens.
A grammar (`params.grammar`) gets one matcher per row and the bit-by-bit reference unpacking of its mask
(`naive_unpack_bitmask`), so the engine's constrained path is tested against this loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from k3.infer.api import SamplingParams, TokenLogprob
from k3.infer.grammar import fill_bitmask, naive_unpack_bitmask
from k3.infer.sampling import sample
from k3.model.model import K3ForCausalLM


@dataclass
class Step:
    """One decoding step of the batch."""

    tokens: torch.Tensor  # [B] long: each row's next token (`pad_id` once the row has stopped)
    logprobs: list[TokenLogprob | None]  # per row, when `params.logprobs` is set (None for a stopped row)
    stopped: torch.Tensor  # [B] bool: the row has written a stop id, at this step or before


@torch.no_grad()
def generate_steps(model: K3ForCausalLM, prompts: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None = None, pad_id: int = 0) -> Iterator[Step]:
    """Decode `params.max_tokens` steps after prompts [B, T] (long), all rows with the same `params`.

    A row stops at any of `params.stop_token_ids`, or when its grammar is complete (the stop token is in that
    step's `tokens`); afterwards
    it gets `pad_id`, which is also what the model reads for it. The loop ends when every row has stopped.
    Sampled rows draw from `generator` one after another (default: seeded 0, on the model's device).
    """
    B, T = prompts.shape
    if T == 0:
        raise ValueError("the prompt must hold at least one token")
    params.validate(model.config.vocab_size)
    device = next(model.parameters()).device
    if generator is None:
        generator = torch.Generator(device=device).manual_seed(0)
    prompts = prompts.to(device)
    prompt_ids, output_ids = prompts.tolist(), [[] for _ in range(B)]
    stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
    stopped = torch.zeros(B, dtype=torch.bool, device=device)
    cache = model.new_cache(B)
    logits = model(prompts, cache=cache).logits[:, -1]  # [B, V]
    matchers = [params.grammar.matcher() for _ in range(B)] if params.grammar is not None else None
    for step in range(params.max_tokens):
        allowed = None
        if matchers is not None:
            live = [None if done else m for m, done in zip(matchers, stopped.tolist())]
            allowed = naive_unpack_bitmask(fill_bitmask(live, logits.shape[-1]), logits.shape[-1]).to(device)
        ids, logprobs = sample(logits, [params] * B, [generator] * B, prompt_ids, output_ids, allowed)
        tokens = torch.where(stopped, pad_id, torch.tensor(ids, device=device))  # [B]
        logprobs = [None if done else lp for done, lp in zip(stopped.tolist(), logprobs)]
        for row, token in zip(output_ids, ids):
            row.append(token)
        done_now = torch.isin(tokens, stop_ids)
        if matchers is not None:
            for b, (m, token, done) in enumerate(zip(matchers, ids, stopped.tolist())):
                if not done:
                    assert m.consume_token(token), m.get_error()
                    done_now[b] |= m.is_stopped()
        stopped = stopped | done_now
        yield Step(tokens, logprobs, stopped)
        if bool(stopped.all()) or step + 1 == params.max_tokens:
            return
        logits = model(tokens[:, None], cache=cache).logits[:, -1]


def generate(model: K3ForCausalLM, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.8,
             top_k: int | None = 50, top_p: float | None = 0.95, stop_ids: set[int] | None = None,
             seed: int = 0) -> Iterator[int]:
    """One prompt: yield up to `max_new_tokens` token ids after `prompt_ids`, stopping before any of `stop_ids`."""
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k or 0,
                            top_p=top_p if top_p is not None else 1.0, stop_token_ids=tuple(sorted(stop_ids or ())))
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for step in generate_steps(model, torch.tensor([prompt_ids]), params, generator):
        if bool(step.stopped[0]):
            return
        yield int(step.tokens[0])
