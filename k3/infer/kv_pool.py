"""External CPU KV pool: write-back of evicted prefix pages (docs/inference.md; K3 report §5.3.1).

A reusable, idle prefix block goes to CPU memory **only when it is evicted** from the device pool, and is
loaded back when a later request hits it. A block moves as one **bundle**: its MLA pages (one per MLA
layer) together with the KDA checkpoints at hash endpoints inside it (one page per KDA layer each), so a
boundary can never be found on the CPU with its MLA pages but without its KDA state, or the reverse.

Storage is one slab of page-sized slots (`uint8` [slots, page_bytes], pinned when the device is CUDA),
an index from block hash to bundle, and LRU over bundles. Copies are synchronous here: on CUDA a
non-blocking copy is followed by an event wait before the device page is freed or the bundle is used
(so no page is reused before its copy lands); overlapping them with compute on side streams is not done.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class HostBundle:
    index: int  # page number inside the sequence
    endpoints: dict[bytes, int]  # block hash -> tokens of the page valid for that prefix
    mla_slots: list[int]  # one slot per MLA layer
    checkpoints: dict[bytes, tuple[int, list[int]]] = field(default_factory=dict)  # hash -> (position, slots)
    pinned: bool = False

    @property
    def slots(self) -> list[int]:
        return self.mla_slots + [s for _, slots in self.checkpoints.values() for s in slots]


class HostKVPool:
    def __init__(self, num_slots: int, page_bytes: int, device: torch.device):
        self.num_slots = num_slots
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.slab = torch.empty(num_slots, page_bytes, dtype=torch.uint8, pin_memory=pin)
        self.device = device
        self.free = list(range(num_slots))[::-1]
        self.lru: OrderedDict[HostBundle, None] = OrderedDict()
        self.block_index: dict[bytes, HostBundle] = {}
        self.checkpoint_index: dict[bytes, HostBundle] = {}
        self.stores = 0
        self.loads = 0  # bundles loaded back (hits)
        self.drops = 0  # bundles dropped by LRU
        self.bytes_out = 0  # device -> CPU
        self.bytes_in = 0  # CPU -> device
        self.hit_tokens = 0

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self.free)

    def store(self, arena: torch.Tensor, index: int, endpoints: dict[bytes, int], mla_pages: list[int],
              checkpoints: dict[bytes, tuple[int, list[int]]]) -> bool:
        """Copy one evicted block (and its checkpoints) out of `arena`. False if it cannot fit."""
        need = len(mla_pages) + sum(len(p) for _, p in checkpoints.values())
        if need > self.num_slots or not endpoints:
            return False
        # a newer copy of the same prefix replaces an older one
        for h in list(endpoints) + list(checkpoints):
            for old in (self.block_index.get(h), self.checkpoint_index.get(h)):
                if old is not None and not old.pinned:
                    self._drop(old)
        while len(self.free) < need:
            victim = next((b for b in self.lru if not b.pinned), None)
            if victim is None:
                return False
            self._drop(victim)
        slots = [self.free.pop() for _ in range(need)]
        pages = list(mla_pages) + [p for _, ps in checkpoints.values() for p in ps]
        self._copy_out(arena, pages, slots)
        it = iter(slots)
        bundle = HostBundle(index, dict(endpoints), [next(it) for _ in mla_pages])
        for h, (pos, ps) in checkpoints.items():
            bundle.checkpoints[h] = (pos, [next(it) for _ in ps])
        for h in bundle.endpoints:
            self.block_index[h] = bundle
        for h in bundle.checkpoints:
            self.checkpoint_index[h] = bundle
        self.lru[bundle] = None
        self.stores += 1
        return True

    def _copy_out(self, arena, pages, slots):
        src = arena[torch.tensor(pages, device=arena.device)]
        if arena.device.type == "cuda":
            staged = src.to("cpu", non_blocking=True)
            torch.cuda.current_stream(arena.device).synchronize()
            self.slab[torch.tensor(slots)] = staged
        else:
            self.slab[torch.tensor(slots)] = src
        self.bytes_out += len(pages) * arena.shape[1]

    def _drop(self, bundle: HostBundle) -> None:
        for h in bundle.endpoints:
            if self.block_index.get(h) is bundle:
                del self.block_index[h]
        for h in bundle.checkpoints:
            if self.checkpoint_index.get(h) is bundle:
                del self.checkpoint_index[h]
        self.lru.pop(bundle, None)
        self.free.extend(bundle.slots)
        self.drops += 1

    def find_block(self, h: bytes) -> HostBundle | None:
        return self.block_index.get(h)

    def find_checkpoint(self, h: bytes) -> HostBundle | None:
        return self.checkpoint_index.get(h)

    def load(self, bundle: HostBundle, arena: torch.Tensor, pages: list[int]) -> None:
        """Copy a bundle into device `pages` (MLA pages, then checkpoint pages in bundle order) and release
        its slots: the device copy is now the live one and will be written back if evicted again."""
        slots = bundle.slots
        assert len(pages) == len(slots)
        src = self.slab[torch.tensor(slots)]
        if arena.device.type == "cuda":
            arena[torch.tensor(pages, device=arena.device)] = src.to(arena.device, non_blocking=True)
            torch.cuda.current_stream(arena.device).synchronize()
        else:
            arena[torch.tensor(pages)] = src
        self.bytes_in += len(slots) * arena.shape[1]
        self.loads += 1
        bundle.pinned = False
        self._drop(bundle)
        self.drops -= 1  # a load is not an LRU drop

    def clear(self) -> None:
        """Drop everything (e.g. after an RL rollout iteration)."""
        for b in list(self.lru):
            self._drop(b)
