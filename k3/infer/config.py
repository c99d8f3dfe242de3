"""EngineConfig: every knob of the inference engine in one dataclass (docs/inference.md).

Sizes are in tokens unless the name says bytes. `None` means "derive it", and `Engine` resolves each one
in one documented place (`k3.infer.engine.Engine.__init__` via `resolve`), so a running engine always
reports concrete values (`engine.config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class EngineConfig:
    # tokens per chained hash block; K3 uses 512, `small` 256, `tiny` 64 (docs/inference.md)
    hash_block_size: int = 64
    # MLA tokens per page; None: the page rule (smallest multiple of the hash block whose MLA page holds
    # at least one KDA layer's state, see `k3.infer.cache.page_tokens_for`)
    page_tokens: int | None = None
    # the one arena of equal pages, on the model's device; None: 256 MiB on CPU, half the free memory on CUDA
    pool_bytes: int | None = None
    num_pages: int | None = None  # overrides pool_bytes when set

    max_running: int = 64  # sequence slots = private KDA states
    max_step_tokens: int = 2048  # tokens of one forward (decodes + prefill pieces)
    prefill_chunk_tokens: int = 512  # prefill pieces end on multiples of this (a multiple of the hash block)
    max_context: int | None = None  # prompt + max_tokens limit; None: the model's, capped by what the pool holds

    enable_prefix_caching: bool = True
    checkpoint_every_blocks: int = 8  # N: a KDA checkpoint every N hash blocks of a long prefill
    model_id: str = "k3"  # mixed into every block hash, so two models never share entries

    cpu_pool_bytes: int = 0  # 0: off
    # projector rows of recent images (a multimodal model), by content key, on the model's device (k3/infer/media.py)
    media_cache_bytes: int = 2**28

    long_request_tokens: int = 2048  # prompt + max_tokens at or above this is a "long" request
    short_budget_tokens: int | None = None  # outstanding prompt+max_tokens of admitted short requests
    long_budget_tokens: int | None = None  # same for long requests; None: derived from the pool
    short_max_requests: int = 1024
    long_max_requests: int = 64

    # decode-only steps: "paged" runs them in place on the pool (k3.infer.decode), "gather" through the copy-in /
    # copy-out reference path like every other step; "auto": paged on CUDA
    decode_path: str = "auto"
    # capture paged decode steps as CUDA graphs, one per padded batch size (those up to max_running)
    cuda_graphs: bool = True
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)

    # speculative decoding (docs/speculative.md): tokens drafted per sequence and step (0: off; needs a drafter),
    # and how KDA states roll back after a rejection: "snapshot" (a state per verified position) or "replay"
    # (the committed state plus the verified positions' inputs, recomputed)
    speculative_tokens: int = 0
    spec_rollback: str = "snapshot"

    eos_token_ids: tuple[int, ...] | None = None  # always stop on these; None: the model config's eos
    seed: int = 0  # seeds the generators of requests that give no seed

    def validate(self) -> None:
        b = self.hash_block_size
        checks = [
            ("hash_block_size", b >= 1),
            ("page_tokens", self.page_tokens is None or (self.page_tokens >= b and self.page_tokens % b == 0)),
            ("pool_bytes", self.pool_bytes is None or self.pool_bytes > 0),
            ("num_pages", self.num_pages is None or self.num_pages >= 2),
            ("max_running", self.max_running >= 1),
            ("max_step_tokens", self.max_step_tokens >= b),
            ("prefill_chunk_tokens", self.prefill_chunk_tokens >= b and self.prefill_chunk_tokens % b == 0),
            ("max_context", self.max_context is None or self.max_context >= 2),
            ("checkpoint_every_blocks", self.checkpoint_every_blocks >= 1),
            ("cpu_pool_bytes", self.cpu_pool_bytes >= 0),
            ("media_cache_bytes", self.media_cache_bytes >= 0),
            ("long_request_tokens", self.long_request_tokens >= 2),
            ("short_budget_tokens", self.short_budget_tokens is None or self.short_budget_tokens >= 1),
            ("long_budget_tokens", self.long_budget_tokens is None or self.long_budget_tokens >= 1),
            ("short_max_requests", self.short_max_requests >= 1),
            ("long_max_requests", self.long_max_requests >= 1),
            ("decode_path", self.decode_path in ("auto", "paged", "gather")),
            ("speculative_tokens", self.speculative_tokens >= 0),
            ("spec_rollback", self.spec_rollback in ("snapshot", "replay")),
            ("graph_batch_sizes", bool(self.graph_batch_sizes) and all(b >= 1 for b in self.graph_batch_sizes)),
        ]
        bad = [name for name, ok in checks if not ok]
        if bad:
            raise ValueError("invalid EngineConfig: " + "; ".join(f"{n} = {getattr(self, n)!r}" for n in bad)
                             + f" (page_tokens and prefill_chunk_tokens must be multiples of hash_block_size "
                               f"{b}; max_step_tokens at least one hash block)")

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)
