"""Images inside the engine: where a request's media rows go, their per-image cache, and their prefix-cache keys
(docs/vision.md, "Serving").

Legend: N patches, n media items, M projector rows (one per `<|media_pad|>` token), D model width.

The engine stays a token engine: a request is prompt ids plus `MediaInput`s (`k3.infer.api`), each the tower's
input for one item and how many `<|media_pad|>` tokens it fills; item k takes the pads k₀ … k₀+n_k−1 in order,
as the multimodal model splices them. The engine never imports the vision package: it is handed an encoder
`(pixel_values [N, 3, p, p], grid_thw [n, 3]) → rows [M, D]` (a `K3VisionLanguageModel`'s `encode_media`).

- **When the tower runs.** In the step whose prefill piece first covers one of an item's pads: the runner asks
  `MediaCache.step_inputs` for the rows of exactly the pads in this step's pieces; items not cached yet are
  encoded together, packed (NaViT), in that step. A prefix-cache hit that covers an image skips its pads, so the
  tower never runs for it.
- **Per-image cache.** Rows are kept per content key (blake2b of the grid and the preprocessed pixels) in an
  LRU bounded in bytes, on the model's device: a repeated image (a later turn, another request, a recompute
  after preemption) is not encoded again. Rows depend on the weights: `Engine.load_weights` clears it.
- **Prefix-cache keys.** A hash block whose positions hold any pad of an item mixes the item's key into its
  chained hash (`block_extra`), so prompts whose pads are identical tokens but stand for different images never
  share a cached prefix; the chain carries it into every later block.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from k3.infer.api import MediaInput

Encoder = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def media_key(item: MediaInput) -> bytes:
    """The item's content key: blake2b-128 over its grid and its preprocessed pixels (exact, never Python's hash)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(tuple(int(v) for v in item.grid_thw)).encode())
    pixels = item.pixel_values.detach().to("cpu", torch.float32).contiguous()
    h.update(pixels.numpy().tobytes())
    return h.digest()


@dataclass
class RequestMedia:
    """One request's media and where their rows go: `positions` holds the prompt positions of its pads in order,
    item k takes the pads `starts[k]` … `starts[k] + items[k].num_tokens − 1`."""

    items: list[MediaInput]
    keys: list[bytes]
    positions: list[int]
    starts: list[int]

    @classmethod
    def build(cls, prompt_ids: Sequence[int], items: Sequence[MediaInput], pad_id: int) -> RequestMedia:
        """Check that the prompt's `<|media_pad|>` tokens are exactly the items' token counts; ValueError if not."""
        items = list(items)
        for k, item in enumerate(items):
            t, h, w = (int(v) for v in item.grid_thw)
            if item.pixel_values.dim() != 4 or item.pixel_values.shape[0] != t * h * w:
                raise ValueError(f"media[{k}]: pixel_values must be [t·h·w, 3, p, p] for grid_thw {item.grid_thw}, "
                                 f"got {list(item.pixel_values.shape)}")
            if item.num_tokens < 1:
                raise ValueError(f"media[{k}]: num_tokens must be >= 1, got {item.num_tokens}")
        positions = [i for i, t in enumerate(prompt_ids) if t == pad_id]
        need = sum(item.num_tokens for item in items)
        if len(positions) != need:
            raise ValueError(f"prompt_ids hold {len(positions)} <|media_pad|> token(s) but the {len(items)} media "
                             f"item(s) fill {need}: expand each item's pad to its token count")
        starts = [0]
        for item in items[:-1]:
            starts.append(starts[-1] + item.num_tokens)
        return cls(items, [item.key or media_key(item) for item in items], positions, starts[: len(items)])

    def spans(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(item, first row, end row) of the pads at positions [start, end), in order."""
        lo, hi = bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, end)
        out = []
        while lo < hi:
            k = bisect.bisect_right(self.starts, lo) - 1
            stop = min(hi, self.starts[k] + self.items[k].num_tokens)
            out.append((k, lo - self.starts[k], stop - self.starts[k]))
            lo = stop
        return out

    def block_extra(self, start: int, end: int) -> bytes:
        """The keys of the items with a pad at positions [start, end): what a hash block over them mixes in."""
        return b"".join(self.keys[k] for k, _, _ in self.spans(start, end))

    def is_pad(self, start: int, end: int) -> list[bool]:
        """Per position of [start, end): does a media row replace it."""
        flags = [False] * (end - start)
        for p in self.positions[bisect.bisect_left(self.positions, start):bisect.bisect_left(self.positions, end)]:
            flags[p - start] = True
        return flags


class MediaCache:
    """Projector rows per content key, least recently used dropped past `capacity_bytes`, filled by `encoder`.

    `encoded` counts items run through the tower, `hits` items served from the cache."""

    def __init__(self, encoder: Encoder, capacity_bytes: int):
        self.encoder = encoder
        self.capacity_bytes = capacity_bytes
        self.rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.encoded = 0
        self.hits = 0

    def clear(self) -> None:
        self.rows.clear()
        self.bytes = 0

    def _store(self, key: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.capacity_bytes:
            return
        self.rows[key] = rows
        self.bytes += size
        while self.bytes > self.capacity_bytes:
            _, old = self.rows.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def lookup(self, needed: Sequence[tuple[bytes, MediaInput]]) -> dict[bytes, torch.Tensor]:
        """Rows of every (key, item): cached ones, the others encoded together in one packed tower call."""
        found: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, MediaInput] = {}
        for key, item in needed:
            if key in found or key in missing:
                continue
            if key in self.rows:
                self.rows.move_to_end(key)
                found[key] = self.rows[key]
                self.hits += 1
            else:
                missing[key] = item
        if missing:
            items = list(missing.values())
            pixels = torch.cat([it.pixel_values for it in items])
            grid = torch.tensor([[int(v) for v in it.grid_thw] for it in items], dtype=torch.int64)
            rows = self.encoder(pixels, grid)
            need = sum(it.num_tokens for it in items)
            if rows.shape[0] != need:
                raise ValueError(f"the encoder gave {rows.shape[0]} rows for media of {need} tokens: an item's "
                                 "num_tokens does not match its grid_thw")
            for key, part in zip(missing, rows.split([it.num_tokens for it in items])):
                found[key] = part
                self._store(key, part)
            self.encoded += len(items)
        return found

    def step_inputs(self, pieces: Sequence[tuple[RequestMedia | None, int, int]]
                    ) -> tuple[torch.Tensor, list[bool]] | None:
        """For one packed step of pieces (request media or None, first position, tokens): the rows [M, D] of the
        pads it runs, in order, and per token of the step whether a row replaces it; None when it runs no pad."""
        spans, flags = [], []
        for media, start, n in pieces:
            if media is None:
                flags += [False] * n
                continue
            spans += [(media, k, lo, hi) for k, lo, hi in media.spans(start, start + n)]
            flags += media.is_pad(start, start + n)
        if not spans:
            return None
        rows = self.lookup([(m.keys[k], m.items[k]) for m, k, _, _ in spans])
        return torch.cat([rows[m.keys[k]][lo:hi] for m, k, lo, hi in spans]), flags
