"""State-aware prefix caching for the hybrid stack (docs/inference.md; K3 report §5.4.1, Fig. 12).

Legend: b hash block tokens, pt page tokens (a multiple of b), m = pt / b hash blocks per page.

- **Hashes.** h_k = blake2b(h_{k-1} ‖ model id ‖ tokens of block k), one per complete hash block, so a
  hash names a whole prefix. Never Python's `hash`.
- **MLA blocks.** A sequence's MLA cache is a list of `MLABlock`s, one per page of tokens, each holding one
  page per MLA layer. A block is indexed under the hash of every complete hash block it holds (the plain rule
  registers a page under its last complete block, advancing as it fills; indexing every endpoint is a
  superset that also finds a shorter prefix inside a full page). The per-layer index is one dict per MLA
  layer (cache group); a block enters and leaves all of them together.
- **KDA checkpoints.** A KDA state can be reused only at a position where it was saved. A `KDACheckpoint`
  is a copy of a sequence's private state (one page per KDA layer) at a hash-aligned position, indexed per
  KDA layer. The engine saves them at the end of a prompt (its last hash boundary before the final
  token), every N hash blocks of a long prefill, and at the latest hash boundary while decoding (the end
  of a turn; the previous decode-time one is recycled). Checkpoints are read-only: a hit copies one into
  the request's private pages.
- **Two-phase lookup.** (1) walk the prompt's pages: a page matches whole by the hash at its end; at the
  first page that does not, the longest hash endpoint inside it that is indexed ends the match. (2) Among
  the matched hash boundaries, take the longest with a checkpoint in **every** KDA layer. The hit is a
  multiple of b, not necessarily of pt (2,800 matching tokens with b = 512 → a hit at 2,560).
- **Consistency.** (a) `acquire` pins every device page of the hit before it allocates anything (CPU
  loads, copy-on-write); (b) registration happens after a step's forward and write-back finished, so a page
  written in this step is never matched before its contents exist; (c) a checkpoint belongs to the MLA
  block holding its endpoint and is evicted with it, from every KDA layer at once (and `evict_page` on
  any page of a unit evicts the whole unit); (d) a hit that ends inside a page gets a private copy of that
  page before the request writes to it (copy-on-write, done by the scheduler).
- **Eviction.** LRU over registered blocks whose pages (and checkpoint pages) only the cache holds. With
  a CPU pool the block and its checkpoints are written back there as one bundle first. When no block is
  idle, an idle checkpoint of a block still in use is dropped (from every KDA layer at once).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from k3.infer.cache import PagePool
from k3.infer.kv_pool import HostBundle, HostKVPool

ROOT_HASH = bytes(16)


def block_hash(prev: bytes, tokens, extra: bytes = b"") -> bytes:
    """The chained hash of one hash block: blake2b-128 over (previous hash, extra keys, token ids)."""
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(extra)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_hashes(hashes: list[bytes], tokens: list[int], block: int, extra: bytes = b"", media=None) -> None:
    """Append the hashes of the complete hash blocks of `tokens` not hashed yet. `media`: the request's
    `k3.infer.media.RequestMedia`; a block holding an image's pads mixes in that image's key, so two different
    images behind the same pad tokens never share a prefix."""
    for k in range(len(hashes), len(tokens) // block):
        key = extra if media is None else extra + media.block_extra(k * block, (k + 1) * block)
        hashes.append(block_hash(hashes[k - 1] if k else ROOT_HASH, tokens[k * block : (k + 1) * block], key))


class MLABlock:
    """One page of tokens of a sequence: one device page per MLA layer."""

    __slots__ = ("pages", "index", "endpoints", "checkpoints", "registered")

    def __init__(self, pages: tuple[int, ...], index: int):
        self.pages = tuple(pages)
        self.index = index  # page number inside the sequence
        self.endpoints: dict[bytes, int] = {}  # hash -> tokens of this page valid for that prefix
        self.checkpoints: dict[bytes, KDACheckpoint] = {}
        self.registered = False

    def __repr__(self):
        return f"MLABlock(index={self.index}, pages={self.pages}, endpoints={len(self.endpoints)})"


class KDACheckpoint:
    """The KDA state of every KDA layer at one hash boundary (one page per KDA layer)."""

    __slots__ = ("pages", "hash", "position", "block", "alive")

    def __init__(self, pages: tuple[int, ...], h: bytes, position: int, block: MLABlock):
        self.pages, self.hash, self.position, self.block, self.alive = tuple(pages), h, position, block, True


# A model without KDA layers needs no state to resume: every MLA boundary is a valid hit.
NO_STATE = "no-state"


@dataclass
class PrefixHit:
    num_tokens: int  # a multiple of the hash block
    units: list  # per page of the hit: MLABlock (device) or HostBundle (CPU pool)
    checkpoint: object  # KDACheckpoint | HostBundle | NO_STATE
    checkpoint_hash: bytes

    @property
    def host_tokens(self) -> int:
        """Tokens of the hit served from the CPU pool (pages loaded back)."""
        return 0 if not any(isinstance(u, HostBundle) for u in self.units) else self.num_tokens


class PrefixCache:
    """Block index, checkpoint index, LRU eviction and allocation-with-eviction over a `PagePool`."""

    def __init__(self, pool: PagePool, enabled: bool, checkpoint_every_blocks: int, model_id: str = "k3",
                 host: HostKVPool | None = None):
        self.pool = pool
        self.spec = pool.spec
        self.enabled = enabled
        self.checkpoint_every_blocks = checkpoint_every_blocks
        self.extra = model_id.encode()
        self.host = host
        self.mla_index: list[dict[bytes, int]] = [{} for _ in self.spec.mla_layers]  # hash -> page, per layer
        self.kda_index: list[dict[bytes, int]] = [{} for _ in self.spec.kda_layers]
        self.owner: dict[int, MLABlock | KDACheckpoint] = {}  # registered page -> its unit
        self.lru: OrderedDict[MLABlock, None] = OrderedDict()  # registered blocks, least recent first
        self.evictions = 0

    def allocate(self, n: int) -> list[int] | None:
        """n pages (refcount 1), evicting idle cached blocks (LRU) as needed; None if impossible."""
        while self.pool.num_free < n:
            if not self.evict_one():
                return None
        return self.pool.allocate(n)

    def _evictable(self, block: MLABlock) -> bool:
        rc = self.pool.refcount
        return all(rc[p] == 1 for p in block.pages) and all(
            rc[p] == 1 for ck in block.checkpoints.values() for p in ck.pages)

    def evict_one(self) -> bool:
        """Evict the least recently used idle block (with its checkpoints); failing that, drop one idle
        checkpoint of a block still in use (a long running prefill must not hoard its checkpoints)."""
        for block in self.lru:
            if self._evictable(block):
                self.evict(block)
                return True
        rc = self.pool.refcount
        for block in self.lru:
            for ck in block.checkpoints.values():
                if all(rc[p] == 1 for p in ck.pages):
                    self.drop_checkpoint(ck)
                    return True
        return False

    def reclaimable(self) -> int:
        """Free pages plus the pages that `evict_one` could give back."""
        n = self.pool.num_free
        rc = self.pool.refcount
        for block in self.lru:
            if self._evictable(block):
                n += len(block.pages)
            n += sum(len(ck.pages) for ck in block.checkpoints.values() if all(rc[p] == 1 for p in ck.pages))
        return n

    def cached_pages(self) -> int:
        """Pages held only by the cache (idle, evictable)."""
        return sum(len(b.pages) + sum(len(c.pages) for c in b.checkpoints.values())
                   for b in self.lru if self._evictable(b))

    def evict(self, block: MLABlock, write_back: bool = True) -> None:
        """Drop a block and its checkpoints from every layer's index at once (CPU write-back first)."""
        if self.host is not None and write_back and block.endpoints:
            self.host.store(self.pool.arena, block.index, block.endpoints, list(block.pages),
                            {h: (ck.position, list(ck.pages)) for h, ck in block.checkpoints.items()})
        for ck in list(block.checkpoints.values()):
            self.drop_checkpoint(ck)
        for h in block.endpoints:
            for idx in self.mla_index:
                del idx[h]
        for p in block.pages:
            self.owner.pop(p, None)
        block.endpoints.clear()
        block.registered = False
        self.lru.pop(block, None)
        self.pool.decref(block.pages)
        self.evictions += 1

    def evict_page(self, page: int) -> None:
        """Evict the unit owning `page` — in every cache group (docs/inference.md)."""
        unit = self.owner[page]
        if isinstance(unit, MLABlock):
            self.evict(unit)
        else:
            self.drop_checkpoint(unit)

    def gpu_block(self, h: bytes) -> MLABlock | None:
        if self.mla_index and all(h in idx for idx in self.mla_index):
            return self.owner[self.mla_index[0][h]]
        return None

    def gpu_checkpoint(self, h: bytes) -> KDACheckpoint | None:
        if self.kda_index and all(h in idx for idx in self.kda_index):
            return self.owner[self.kda_index[0][h]]
        return None

    def register_endpoint(self, block: MLABlock, h: bytes, tokens_in_page: int) -> None:
        """Index `block` under prefix hash h (no-op if another block already holds that prefix)."""
        if not self.enabled or any(h in idx for idx in self.mla_index):
            return
        for j, idx in enumerate(self.mla_index):
            idx[h] = block.pages[j]
        block.endpoints[h] = tokens_in_page
        if not block.registered:
            block.registered = True
            self.pool.incref(block.pages)  # the cache's own reference
            for p in block.pages:
                self.owner[p] = block
        self.lru[block] = None
        self.lru.move_to_end(block)

    def _add_checkpoint(self, block: MLABlock, h: bytes, position: int, pages: list[int]) -> KDACheckpoint:
        ck = KDACheckpoint(tuple(pages), h, position, block)
        for j, idx in enumerate(self.kda_index):
            idx[h] = pages[j]
        for p in pages:
            self.owner[p] = ck
        self.pool.incref(pages)  # the cache's reference
        block.checkpoints[h] = ck
        return ck

    def save_checkpoint(self, state_pages: list[int], h: bytes, position: int) -> KDACheckpoint | None:
        """Copy a private KDA state (one page per KDA layer) into a checkpoint at prefix h (hash-aligned
        `position`). The endpoint h must be indexed; returns None when it exists already or no page is free."""
        if not self.enabled or not self.kda_index or any(h in idx for idx in self.kda_index):
            return None
        block = self.gpu_block(h)
        if block is None:
            return None
        self.pool.incref(block.pages)  # keep the owner block from being evicted by this allocation
        pages = self.allocate(len(self.kda_index))
        self.pool.decref(block.pages)
        if pages is None:
            return None
        self.pool.copy(pages, state_pages)
        ck = self._add_checkpoint(block, h, position, pages)
        self.pool.decref(pages)  # drop the allocation's reference; the cache holds one
        return ck

    def drop_checkpoint(self, ck: KDACheckpoint) -> None:
        """Unregister a checkpoint from every KDA layer at once and release the cache's reference."""
        if not ck.alive:
            return
        ck.alive = False
        for idx in self.kda_index:
            del idx[ck.hash]
        for p in ck.pages:
            self.owner.pop(p, None)
        del ck.block.checkpoints[ck.hash]
        self.pool.decref(ck.pages)

    def _find_block(self, h: bytes, use_host: bool):
        block = self.gpu_block(h)
        if block is None and use_host and self.host is not None:
            return self.host.find_block(h)
        return block

    def _find_checkpoint(self, h: bytes, use_host: bool):
        if not self.kda_index:
            return NO_STATE
        ck = self.gpu_checkpoint(h)
        if ck is None and use_host and self.host is not None:
            return self.host.find_checkpoint(h)
        return ck

    def lookup(self, hashes: list[bytes], max_tokens: int, use_host: bool = True) -> PrefixHit | None:
        """The longest reusable prefix of at most `max_tokens` tokens (two-phase, see module docstring)."""
        if not self.enabled:
            return None
        b, pt = self.spec.hash_block, self.spec.page_tokens
        m = pt // b
        usable = min(len(hashes), max_tokens // b)
        units, ends = [], []
        page = 0
        # phase 1: MLA pages by chained hash
        while page * m < usable:
            first, last = page * m, min(page * m + m, usable) - 1
            found = None
            for k in range(last, first - 1, -1):
                unit = self._find_block(hashes[k], use_host)
                if unit is not None:
                    found = (k, unit)
                    break
            if found is None:
                break
            k, unit = found
            units.append(unit)
            ends.extend(range(first, k + 1))
            if k != first + m - 1:
                break
            page += 1
        # phase 2: the longest of those boundaries with a KDA checkpoint in every KDA layer
        for k in reversed(ends):
            ck = self._find_checkpoint(hashes[k], use_host)
            if ck is not None:
                n = (k + 1) * b
                return PrefixHit(n, units[: (n - 1) // pt + 1], ck, hashes[k])
        return None

    def acquire(self, hit: PrefixHit) -> tuple[list[MLABlock], KDACheckpoint | None] | None:
        """Pin the hit for one request: returns its blocks (one reference each, the caller's) and the
        checkpoint (also referenced; release with `pool.decref(ck.pages)` after copying it). CPU-pool
        bundles are loaded back first. None (nothing held) if the pool cannot hold the loads."""
        pool = self.pool
        # (a) pin everything already on the device before any allocation
        for u in hit.units:
            if isinstance(u, MLABlock):
                pool.incref(u.pages)
                self.lru.move_to_end(u)
        if isinstance(hit.checkpoint, KDACheckpoint):
            pool.incref(hit.checkpoint.pages)
        bundles = [u for u in hit.units if isinstance(u, HostBundle)]
        if isinstance(hit.checkpoint, HostBundle) and hit.checkpoint not in bundles:
            bundles.append(hit.checkpoint)
        for bd in bundles:
            bd.pinned = True
        loaded: dict[int, MLABlock] = {}
        for i, bd in enumerate(bundles):
            pages = self.allocate(len(bd.slots))
            if pages is None:
                for rest in bundles[i:]:
                    rest.pinned = False
                self._unpin(hit, loaded)
                return None
            self.host.load(bd, pool.arena, pages)
            loaded[id(bd)] = self._install(bd, pages)
        blocks = [loaded[id(u)] if isinstance(u, HostBundle) else u for u in hit.units]
        used = {id(b) for b in blocks}
        for block in loaded.values():
            if id(block) not in used:
                pool.decref(block.pages)  # loaded only for its checkpoint
        ck = hit.checkpoint
        if isinstance(ck, HostBundle):
            ck = self.gpu_checkpoint(hit.checkpoint_hash)
            assert ck is not None
            pool.incref(ck.pages)
        return blocks, (ck if isinstance(ck, KDACheckpoint) else None)

    def _unpin(self, hit: PrefixHit, loaded: dict[int, MLABlock]) -> None:
        for u in hit.units:
            if isinstance(u, MLABlock):
                self.pool.decref(u.pages)
        if isinstance(hit.checkpoint, KDACheckpoint):
            self.pool.decref(hit.checkpoint.pages)
        for block in loaded.values():
            self.pool.decref(block.pages)

    def _install(self, bd: HostBundle, pages: list[int]) -> MLABlock:
        """Index a bundle just loaded into `pages` (MLA pages first). The block's pages keep the
        allocation's reference (the caller's); checkpoint pages keep only the cache's."""
        n_mla = len(bd.mla_slots)
        block = MLABlock(tuple(pages[:n_mla]), bd.index)
        for h, n in bd.endpoints.items():
            self.register_endpoint(block, h, n)
        rest = pages[n_mla:]
        for h, (pos, slots) in bd.checkpoints.items():
            ps, rest = rest[: len(slots)], rest[len(slots):]
            owner = self.gpu_block(h)
            if owner is not None and self.gpu_checkpoint(h) is None:
                self._add_checkpoint(owner, h, pos, ps)
            self.pool.decref(ps)
        return block
