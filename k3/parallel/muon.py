"""P2P Muon: Newton–Schulz on whole blocks, with each block's rows sent only to its owner (docs/distributed.md).

Legend: W ranks; a *unit* is one Newton–Schulz block of a Muon parameter (a whole matrix, one head's rows,
one expert); in the row space of a parameter (its dim 0 flattened with the middle dims, last dim = cols)
every unit is a contiguous range of rows, and a FSDP2/EP shard (`Shard(0)`) is too.

Plan, fixed at construction from shapes only (identical on every rank, no communication):
- each rank's row range of every sharded parameter (torch.chunk semantics of `Shard(0)`);
- an owner per unit: a unit held by one rank is owned there (zero traffic); the others go by LPT on the
  Newton–Schulz cost 5·(4s²l + 2s³) (s, l = min, max of the block's sides) to the least loaded rank,
  ties to the rank holding most of its rows, then the lowest rank.

Step (replacing `MuonAdamW._orthogonalize`): units held whole by one rank are orthogonalised in place
there; for the others, holders cut their Nesterov rows per unit and send each slice to the unit's owner —
one `all_to_all_single` with per-peer splits, so nothing goes to a rank that does not own it; the owner
stacks equal-shape units and runs one batched NS per shape (`k3.optim.muon.orthogonalize_blocks`); the
update rows go back by the inverse `all_to_all_single`; each holder updates its own rows (momentum and
parameters never leave their rank). One exchange per step, not overlapped with compute.
`bytes_sent` counts what left this rank (self-slices excluded).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from k3.optim.muon import MuonAdamW, orthogonalize_blocks


@dataclass(frozen=True)
class Unit:
    param: int  # index into the Muon parameters
    row0: int  # first row in the parameter's row space
    rows: int  # block rows (row space)
    cols: int
    owner: int


def _row_ranges(dim0: int, rows_per_dim0: int, world: int) -> list[tuple[int, int]]:
    """Row-space range [a, b) each rank holds under Shard(0) (torch.chunk: ceil-sized, trailing may be empty)."""
    chunk = math.ceil(dim0 / world) if dim0 else 0
    return [(min(r * chunk, dim0) * rows_per_dim0, min((r + 1) * chunk, dim0) * rows_per_dim0) for r in range(world)]


def ns_cost(rows: int, cols: int) -> int:
    s, l = min(rows, cols), max(rows, cols)
    return 5 * (4 * s * s * l + 2 * s ** 3)


class DistributedMuonAdamW(MuonAdamW):
    """MuonAdamW over DTensor parameters sharded with `Shard(0)` on 1-D meshes spanning the same ranks.

    Plain (replicated) parameters are orthogonalised locally as in the single-process optimizer.
    """

    def __init__(self, named_params, config, group=None, **kwargs):
        named_params = list(named_params)
        super().__init__(named_params, config, **kwargs)
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.bytes_sent = 0
        self._muon = [p for p in self.param_groups[0]["params"]]
        assert self.param_groups[0]["kind"] == "muon"
        self._ranges: dict[int, list[tuple[int, int]]] = {}
        units: list[tuple[int, int, int, int]] = []  # (param, row0, rows, cols)
        for i, p in enumerate(self._muon):
            if not hasattr(p, "to_local"):
                continue
            placements = p.placements
            if p.device_mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard(0):
                raise ValueError(f"P2P Muon needs parameters sharded Shard(0) on a 1-D mesh, got {placements}")
            if p.device_mesh.size() != self.world:
                raise ValueError("every sharded parameter must span the optimizer's group")
            shape = p.shape
            rows_per_dim0 = math.prod(shape[1:-1]) if len(shape) > 2 else 1
            self._ranges[i] = _row_ranges(shape[0], rows_per_dim0, self.world)
            a, b = self._ranges[i][self.rank]
            if p.to_local().numel() != (b - a) * shape[-1]:
                raise ValueError(f"parameter {i}: local shard does not match Shard(0) chunking")
            n_blocks, rows, cols = self.block_shapes[p]
            for u in range(n_blocks):
                units.append((i, u * rows, rows, cols))
        self._units = self._assign_owners(units)
        self._build_exchange()

    def _holders(self, param: int, row0: int, rows: int) -> list[tuple[int, int, int]]:
        """(rank, first row, last row) of each rank holding part of rows [row0, row0 + rows)."""
        out = []
        for r, (a, b) in enumerate(self._ranges[param]):
            lo, hi = max(a, row0), min(b, row0 + rows)
            if lo < hi:
                out.append((r, lo, hi))
        return out

    def _assign_owners(self, units) -> list[Unit]:
        load = [0] * self.world
        owner: dict[int, int] = {}
        for j, (i, row0, rows, cols) in enumerate(units):
            holders = self._holders(i, row0, rows)
            if len(holders) == 1:
                owner[j] = holders[0][0]
                load[owner[j]] += ns_cost(rows, cols)
        split = sorted((j for j in range(len(units)) if j not in owner),
                       key=lambda j: (-ns_cost(units[j][2], units[j][3]), j))
        for j in split:
            i, row0, rows, cols = units[j]
            held = defaultdict(int)
            for r, lo, hi in self._holders(i, row0, rows):
                held[r] += hi - lo
            r = min(range(self.world), key=lambda r: (load[r], -held[r], r))
            owner[j] = r
            load[r] += ns_cost(rows, cols)
        self.ns_load = load
        return [Unit(i, row0, rows, cols, owner[j]) for j, (i, row0, rows, cols) in enumerate(units)]

    def _build_exchange(self) -> None:
        """Per peer, in unit order: the slices this rank sends (and later receives back) and receives."""
        self._send = [[] for _ in range(self.world)]  # peer -> [(param, local row a, local row b)]
        self._recv = [[] for _ in range(self.world)]  # peer -> [(unit index, row offset in unit, nrows)]
        self._local = []  # units held only here (hence owned here): [(unit, param, local row a, local row b)]
        for u, unit in enumerate(self._units):
            holders = self._holders(unit.param, unit.row0, unit.rows)
            if len(holders) == 1 and holders[0][0] == self.rank:
                base = self._ranges[unit.param][self.rank][0]
                self._local.append((u, unit.param, holders[0][1] - base, holders[0][2] - base))
                continue
            for r, lo, hi in holders:
                if r == self.rank:
                    base = self._ranges[unit.param][self.rank][0]
                    self._send[unit.owner].append((unit.param, lo - base, hi - base, unit.cols))
                if unit.owner == self.rank:
                    self._recv[r].append((u, lo - unit.row0, hi - lo))
        self._send_splits = [sum((b - a) * c for _, a, b, c in items) for items in self._send]
        self._recv_splits = [sum(n * self._units[u].cols for u, _, n in items) for items in self._recv]

    def _orthogonalize(self, params, nesterov, ns_dtype, steps):
        updates: list[Tensor | None] = [None] * len(params)
        index = {id(p): j for j, p in enumerate(self._muon)}
        local_plain = [(k, p, n) for k, (p, n) in enumerate(zip(params, nesterov)) if not hasattr(p, "to_local")]
        if local_plain:
            outs = super()._orthogonalize([p for _, p, _ in local_plain], [n for _, _, n in local_plain],
                                          ns_dtype, steps)
            for (k, _, _), o in zip(local_plain, outs):
                updates[k] = o
        sharded = {index[id(p)]: (k, n) for k, (p, n) in enumerate(zip(params, nesterov)) if hasattr(p, "to_local")}
        if not sharded:
            return updates
        if len(sharded) != len(self._ranges):
            # every rank must join the exchange with the same layout: all sharded parameters step together
            raise RuntimeError("P2P Muon: some sharded Muon parameters have no gradient on this step")
        rows_of = {i: n.reshape(-1, n.shape[-1]) for i, (_, n) in sharded.items()}  # local row space

        # rows travel in the Newton–Schulz dtype: the owner casts them to it on stacking anyway, and NS returns
        # it, so bf16 on the wire halves the bytes and changes no bit of the update
        send = torch.cat([rows_of[i][a:b].reshape(-1) for items in self._send for i, a, b, _ in items]
                         or [torch.zeros(0, device=params[0].device)]).to(ns_dtype)
        recv = send.new_empty(sum(self._recv_splits))
        dist.all_to_all_single(recv, send, self._recv_splits, self._send_splits, group=self.group)
        self.bytes_sent += send.element_size() * (sum(self._send_splits) - self._send_splits[self.rank])

        # assemble owned units, NS per shape, cut the results back into the same slices
        # units that never leave this rank skip the exchange (no copies through a self all-to-all)
        owned: dict[int, Tensor] = {u: rows_of[i][a:b] for u, i, a, b in self._local}
        pos = 0
        pieces = []
        for items in self._recv:
            for u, off, n in items:
                unit = self._units[u]
                block = owned.setdefault(u, recv.new_empty(unit.rows, unit.cols))
                block[off:off + n] = recv[pos:pos + n * unit.cols].view(n, unit.cols)
                pos += n * unit.cols
                pieces.append((u, off, n))
        ortho = self._ns_units(owned, ns_dtype, steps)
        back = torch.cat([ortho[u][off:off + n].reshape(-1) for u, off, n in pieces] or [recv.new_zeros(0)])
        returned = send.new_empty(sum(self._send_splits))
        dist.all_to_all_single(returned, back.to(ns_dtype), self._send_splits, self._recv_splits, group=self.group)
        self.bytes_sent += returned.element_size() * (sum(self._recv_splits) - self._recv_splits[self.rank])

        out_rows = {i: torch.empty_like(r, dtype=torch.float32) for i, r in rows_of.items()}
        pos = 0
        for items in self._send:
            for i, a, b, c in items:
                out_rows[i][a:b] = returned[pos:pos + (b - a) * c].view(b - a, c)
                pos += (b - a) * c
        for u, i, a, b in self._local:
            out_rows[i][a:b] = ortho[u]
        for i, (k, n) in sharded.items():
            updates[k] = out_rows[i].view(n.shape)
        return updates

    @staticmethod
    def _ns_units(owned: dict[int, Tensor], ns_dtype, steps) -> dict[int, Tensor]:
        """NS5 of each owned unit [rows, cols], batched by shape; returns fp32 results in the same shapes."""
        ortho = orthogonalize_blocks(((u, block[None]) for u, block in owned.items()), ns_dtype, steps)
        return {u: o[0].float() for u, o in ortho.items()}
