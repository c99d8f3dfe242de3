"""The hybrid paged pool: MLA latent pages and KDA state pages in one arena of equal pages (docs/inference.md).

Legend: N sequences, P pages, pt page tokens, D = kv_lora_rank + qk_rope_head_dim (latent width),
H heads, K head dim, W-1 conv tail rows, C = H·K conv channels.

- **Page rule.** page_tokens = the smallest multiple of the hash block with page_tokens × (MLA bytes per
  token per layer) ≥ (KDA bytes per layer: fp32 state + conv tails). K3: 6144 (hash 512), small: 1024
  (hash 256), tiny: 384 (hash 64), all at 2-byte caches. Every page is then large enough for either use.
- **One arena.** `PagePool.arena` is one `uint8` tensor [P, page_bytes] on the model's device with one
  free list and page refcounts. Cache groups view the same bytes as typed tensors: an MLA page is
  [pt, D] latents of one MLA layer; a KDA page is one KDA layer's recurrent state [H, K, K] fp32
  followed by its three conv tails [3, W-1, C]. A page serves one group at a time.
- **Gather / scatter.** An engine step copies the scheduled sequences' pages into a `K3Cache` (padded
  MLA rows, stacked KDA states), runs the model's ragged incremental forward, then writes the new latent
  rows and the new KDA states back. This is the reference data path (the model reads contiguous
  tensors); a paged attention kernel would read the pages in place.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from k3.config import ModelConfig
from k3.model.cache import K3Cache, KDAState, MLALatent

PAGE_ALIGN = 64  # bytes; keeps every typed view of a page aligned


def mla_bytes_per_token_layer(config: ModelConfig, cache_bytes: int = 2) -> int:
    return (config.kv_lora_rank + config.qk_rope_head_dim) * cache_bytes


def kda_bytes_per_layer(config: ModelConfig, cache_bytes: int = 2) -> int:
    """One sequence's state in one KDA layer: fp32 S [H, K, K] + conv tails 3 × (W-1) × H·K."""
    lin = config.linear_attn_config
    P = lin.num_heads * lin.head_dim
    return lin.num_heads * lin.head_dim * lin.head_dim * 4 + 3 * (lin.short_conv_kernel_size - 1) * P * cache_bytes


def page_tokens_for(config: ModelConfig, hash_block: int, cache_bytes: int = 2) -> int:
    """The page rule (docs/inference.md): smallest multiple of `hash_block` whose MLA page holds a KDA state."""
    need = kda_bytes_per_layer(config, cache_bytes) if config.kda_layer_ids else 0
    per_block = hash_block * mla_bytes_per_token_layer(config, cache_bytes)
    return max(1, math.ceil(need / per_block)) * hash_block


@dataclass(frozen=True)
class CacheSpec:
    """Shapes and byte layout of the pool for one model."""

    num_layers: int
    mla_layers: tuple[int, ...]  # 0-based decoder layer ids, one MLA cache group each
    kda_layers: tuple[int, ...]  # one KDA cache group each
    hash_block: int
    page_tokens: int
    latent_dim: int  # D
    num_heads: int
    head_dim: int
    conv_rows: int  # W - 1
    dtype: torch.dtype  # MLA latents and conv tails (the model's activation dtype); KDA S is fp32

    @classmethod
    def build(cls, config: ModelConfig, hash_block: int, dtype: torch.dtype,
              page_tokens: int | None = None) -> CacheSpec:
        lin = config.linear_attn_config
        elt = torch.empty(0, dtype=dtype).element_size()
        return cls(
            num_layers=config.num_hidden_layers,
            mla_layers=tuple(config.mla_layer_ids),
            kda_layers=tuple(config.kda_layer_ids),
            hash_block=hash_block,
            page_tokens=page_tokens or page_tokens_for(config, hash_block, elt),
            latent_dim=config.kv_lora_rank + config.qk_rope_head_dim,
            num_heads=lin.num_heads,
            head_dim=lin.head_dim,
            conv_rows=lin.short_conv_kernel_size - 1,
            dtype=dtype,
        )

    @property
    def elt(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def mla_page_bytes(self) -> int:
        return self.page_tokens * self.latent_dim * self.elt

    @property
    def kda_state_bytes(self) -> int:
        return self.num_heads * self.head_dim * self.head_dim * 4

    @property
    def kda_conv_bytes(self) -> int:
        return 3 * self.conv_rows * self.num_heads * self.head_dim * self.elt

    @property
    def page_bytes(self) -> int:
        kda = self.kda_state_bytes + self.kda_conv_bytes if self.kda_layers else 0
        return math.ceil(max(self.mla_page_bytes, kda) / PAGE_ALIGN) * PAGE_ALIGN

    def pages_for_tokens(self, n: int) -> int:
        """MLA pages (all layers) for n cached tokens."""
        return math.ceil(n / self.page_tokens) * len(self.mla_layers)


class PagePool:
    """One arena of equal pages, a free list and refcounts. Pages are referenced by int ids."""

    def __init__(self, spec: CacheSpec, num_pages: int, device: torch.device | str = "cpu"):
        if num_pages < 1:
            raise ValueError("the pool needs at least one page")
        self.spec = spec
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.arena = torch.zeros(num_pages, spec.page_bytes, dtype=torch.uint8, device=self.device)
        # typed views of the same bytes, one per kind of cache group
        s = spec
        self.mla = self.arena[:, : s.mla_page_bytes].view(s.dtype).view(num_pages, s.page_tokens, s.latent_dim)
        if s.kda_layers:
            a, b = s.kda_state_bytes, s.kda_state_bytes + s.kda_conv_bytes
            self.kda_state = self.arena[:, :a].view(torch.float32).view(num_pages, s.num_heads, s.head_dim, s.head_dim)
            self.kda_conv = self.arena[:, a:b].view(s.dtype).view(num_pages, 3, s.conv_rows, s.num_heads * s.head_dim)
        self.refcount = [0] * num_pages
        self.free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int] | None:
        """n pages with refcount 1, or None (nothing taken) when fewer than n are free."""
        if n > len(self.free):
            return None
        pages = [self.free.popleft() for _ in range(n)]
        for p in pages:
            assert self.refcount[p] == 0
            self.refcount[p] = 1
        return pages

    def incref(self, pages: Seq[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"page {p} is free"
            self.refcount[p] += 1

    def decref(self, pages: Seq[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"page {p} freed twice"
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self.free.append(p)

    def copy(self, dst: Seq[int], src: Seq[int]) -> None:
        """Whole-page byte copies (copy-on-write, checkpoints)."""
        if dst:
            src_t = torch.tensor(list(src), device=self.device)
            self.arena[torch.tensor(list(dst), device=self.device)] = self.arena[src_t]

    def zero(self, pages: Seq[int]) -> None:
        if pages:
            self.arena[torch.tensor(list(pages), device=self.device)] = 0


def gather(pool: PagePool, blocks: list[list], kda_pages: list[list[int]], lengths: list[int]) -> K3Cache:
    """The scheduled sequences' state as a `K3Cache` for a ragged incremental forward.

    blocks[n]: sequence n's MLABlocks (each with `.pages`, one per MLA group); kda_pages[n]: its private
    KDA pages (one per KDA group); lengths[n]: its cached tokens. MLA rows past lengths[n] are padding.
    """
    spec, dev = pool.spec, pool.device
    N = len(lengths)
    cache = K3Cache(spec.num_layers, N)
    cache.lengths = list(lengths)
    S = max(lengths)
    nb = math.ceil(S / spec.page_tokens)
    for j, layer in enumerate(spec.mla_layers):
        if S == 0:
            latent = torch.zeros(N, 0, spec.latent_dim, dtype=spec.dtype, device=dev)
        else:
            table = [[b.pages[j] for b in blks[:nb]] + [0] * (nb - min(nb, len(blks))) for blks in blocks]
            latent = pool.mla[torch.tensor(table, device=dev)]  # [N, nb, pt, D]
            latent = latent.view(N, nb * spec.page_tokens, spec.latent_dim)[:, :S]  # [N, S, D]
        cache.layers[layer] = MLALatent(latent)
    for j, layer in enumerate(spec.kda_layers):
        idx = torch.tensor([pages[j] for pages in kda_pages], device=dev)
        conv = pool.kda_conv[idx]  # [N, 3, W-1, C]
        cache.layers[layer] = KDAState(conv[:, 0], conv[:, 1], conv[:, 2], pool.kda_state[idx])
    return cache


def scatter(pool: PagePool, cache: K3Cache, blocks: list[list], kda_pages: list[list[int]],
            old_lengths: list[int], counts: list[int]) -> None:
    """Write back what a forward added: latent rows old_lengths[n] … +counts[n] into sequence n's MLA pages
    (which must exist), and the new KDA states into its private KDA pages."""
    spec, dev = pool.spec, pool.device
    pt = spec.page_tokens
    rows, pos, page_of, offs = [], [], [], []
    for n, (start, c) in enumerate(zip(old_lengths, counts)):
        for p in range(start, start + c):
            rows.append(n)
            pos.append(p)
            page_of.append((n, p // pt))
            offs.append(p % pt)
    rows_t = torch.tensor(rows, device=dev)
    pos_t = torch.tensor(pos, device=dev)
    offs_t = torch.tensor(offs, device=dev)
    for j, layer in enumerate(spec.mla_layers):
        pages = torch.tensor([blocks[n][i].pages[j] for n, i in page_of], device=dev)
        pool.mla[pages, offs_t] = cache.layers[layer].latent[rows_t, pos_t].to(spec.dtype)
    for j, layer in enumerate(spec.kda_layers):
        st = cache.layers[layer]
        idx = torch.tensor([pages[j] for pages in kda_pages], device=dev)
        pool.kda_state[idx] = st.recurrent.float()
        pool.kda_conv[idx] = torch.stack([st.conv_q, st.conv_k, st.conv_v], dim=1).to(spec.dtype)
