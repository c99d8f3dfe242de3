"""The draft model inside the inference engine: `DraftRunner` implements `k3.infer.speculative.Drafter` over a
trained `Draft` (docs/speculative.md, "In the engine").

Legend: N sequences, T packed positions, D model width, F = 3D feature width, V vocabulary, C + R latent width.

Per sequence the runner keeps the draft's MLA latent cache (one row per position: the block's latent of the fused
target feature at t and the embedding of token t + 1, exactly the training-time test's step-1 states), the rows of
its current proposal chain (tentative: dropped by the next `extend`), and its last output g (the next chained
step's input). The cache covers the positions verified since the sequence was (re)admitted: positions served by a
prefix-cache hit were never run, so the draft attends to fewer of them (its MLA is NoPE, so nothing shifts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from k3.model.cache import MLALatent
from k3.model.model import K3ForCausalLM
from k3.model.sequence import SequenceLayout
from k3.spec.draft import Draft, draft_logits


@dataclass
class DraftCache:
    latents: Tensor  # [S, C + R]: committed rows, then the proposal chain's
    committed: int  # rows from verified positions
    next_position: int  # the absolute position after the last committed row
    last: Tensor  # [D]: the draft's newest output, the next chained step's input


class DraftRunner:
    """`Drafter` over a `Draft` and its frozen target (embedding, final norm and head shared with it)."""

    def __init__(self, draft: Draft, target: K3ForCausalLM):
        if draft.config.hidden_size != target.config.hidden_size or draft.config.vocab_size != target.config.vocab_size:
            raise ValueError("the draft was trained for another target shape (hidden size or vocabulary differs)")
        param = next(target.parameters())
        self.draft = draft.to(device=param.device, dtype=target.model.embed_tokens.weight.dtype).eval()
        self.target = target
        self.feature_blocks = draft.feature_blocks
        self.caches: dict[str, DraftCache] = {}
        width = draft.config.kv_lora_rank + draft.config.qk_rope_head_dim
        self._empty = torch.zeros(0, width, dtype=self.draft.fc.weight.dtype, device=param.device)

    @classmethod
    def load(cls, path, target: K3ForCausalLM) -> DraftRunner:
        """A `k3 train-draft` run folder or checkpoint (verified) for this target."""
        from k3.spec.train import load_draft

        draft, _ = load_draft(path, device=next(target.parameters()).device)
        return cls(draft, target)

    @torch.inference_mode()
    def extend(self, request_ids: list[str], starts: list[int], features: list[Tensor],
               next_tokens: list[list[int]]) -> Tensor:
        caches = []
        for rid, start in zip(request_ids, starts):
            cache = self.caches.get(rid)
            if cache is None or cache.next_position != start:  # new, recomputed, or resumed after a prefix hit
                cache = DraftCache(self._empty, 0, start, None)
                self.caches[rid] = cache
            cache.latents = cache.latents[: cache.committed]
            caches.append(cache)
        device = self._empty.device
        hidden = self.draft.fuse(torch.cat(features).to(device))[None]  # [1, T, D]
        flat = [t for tokens in next_tokens for t in tokens]
        embeds = self.target.model.embed_tokens(torch.tensor(flat, device=device))[None]
        counts = [len(t) for t in next_tokens]
        self._run(caches, hidden, embeds, counts)
        for cache, n in zip(caches, counts):
            cache.committed += n
            cache.next_position += n
        return draft_logits(self.target, torch.stack([c.last for c in caches]))

    @torch.inference_mode()
    def propose(self, request_ids: list[str], tokens: list[int]) -> Tensor:
        caches = [self.caches[rid] for rid in request_ids]
        device = self._empty.device
        hidden = torch.stack([c.last for c in caches])[None]  # [1, N, D]
        embeds = self.target.model.embed_tokens(torch.tensor(tokens, device=device))[None]
        self._run(caches, hidden, embeds, [1] * len(caches))
        return draft_logits(self.target, torch.stack([c.last for c in caches]))

    def release(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    def _run(self, caches: list[DraftCache], hidden: Tensor, embeds: Tensor, counts: list[int]) -> Tensor:
        """The draft block over each sequence's new positions (ragged, causal over its cache); appends their
        latents and keeps each sequence's last output. hidden, embeds [1, T, D] -> g [1, T, D]."""
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        layout = SequenceLayout.build(1, cu[-1], torch.tensor(cu), hidden.device)
        past = [c.latents.shape[0] for c in caches]
        layout.past_lengths = past
        padded = self._empty.new_zeros(len(caches), max(past), self._empty.shape[-1])
        for n, c in enumerate(caches):
            padded[n, : past[n]] = c.latents
        g, grown = self.draft(hidden, embeds, layout, MLALatent(padded), use_cache=True)
        for n, c in enumerate(caches):
            c.latents = grown.latent[n, : past[n] + counts[n]]
            c.last = g[0, cu[n + 1] - 1]
        return g
