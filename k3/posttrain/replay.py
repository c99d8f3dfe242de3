"""MoE routing replay for RL: record which experts every token was routed to during the rollout, and route the
training forward the same way (K3 report §4.1.2: rollout and training share routes and precision).

Legend: P positions of a sequence, L MoE layers, k experts per token, b the engine's hash block.

Without replay, the trainer recomputes each token's top-k from its own forward; rounding differences between the
engine (batched decode, paged caches) and the trainer (packed training rows), and the weights moving between a
partial rollout's pieces, flip near-tied experts, so the trainer would take gradients through experts that never
produced the sampled token. With replay the routed experts are inputs of the training forward; the router still
gets its gradient through the weights of the replayed experts.

Recording (`RouteRecorder`) hooks the engine's model runner (`ModelRunner.route_sink`) and keeps, per request, the
[P, L, k] expert ids of every position the engine computed. Positions served by the prefix cache were computed by
another request: the recorder keeps the routes of every complete hash block it saw, keyed by the same chained
block hash the prefix cache uses, and copies them into the request that hit. A preempted request recomputes its
tail; the recomputed routes replace the old ones. `clear()` drops the block routes when the engine's weights
change (the prefix cache is dropped then too).

Replaying (`replayed_routes`) sets each MoE layer's `replay_topk` for one forward; rows of −1 route as usual.
"""

from __future__ import annotations

import contextlib

import torch

from k3.infer.engine import Engine
from k3.infer.prefix_cache import ROOT_HASH, block_hash
from k3.model.model import K3ForCausalLM
from k3.model.moe import StableLatentMoE


def moe_modules(model: K3ForCausalLM) -> list[StableLatentMoE]:
    return [layer.block_sparse_moe for layer in model.model.layers if layer.is_moe]


class _Record:
    """One request's routes: a growing [capacity, L, k] int16 buffer, its length, and its block hashes."""

    def __init__(self, layers: int, k: int):
        self.buf = torch.empty(64, layers, k, dtype=torch.int16)
        self.length = 0
        self.hashes: list[bytes] = []
        self.registered = 0  # complete hash blocks offered to the block table

    def append(self, rows: torch.Tensor) -> None:
        end = self.length + rows.shape[0]
        if end > self.buf.shape[0]:
            grown = torch.empty(max(end, 2 * self.buf.shape[0]), *self.buf.shape[1:], dtype=self.buf.dtype)
            grown[: self.length] = self.buf[: self.length]
            self.buf = grown
        self.buf[self.length:end] = rows
        self.length = end

    def routes(self) -> torch.Tensor:
        return self.buf[: self.length].clone()


class RouteRecorder:
    """Records every request's routes on `engine` (see the module docstring); `take(request_id)` hands them over."""

    def __init__(self, engine: Engine):
        model = engine.runner.model
        moes = moe_modules(model)
        if not moes:
            raise ValueError("routing replay needs a model with MoE layers")
        self.engine = engine
        self.layers, self.k = len(moes), moes[0].top_k
        self.block = engine.spec.hash_block
        self.extra = engine.prefix.extra
        self.records: dict[str, _Record] = {}
        self.blocks: dict[bytes, torch.Tensor] = {}  # chained hash of a complete block -> its routes [b, L, k]
        engine.runner.route_sink = self.sink

    def sink(self, batch, cu: list[int], router_infos) -> None:
        """Called by the engine after each forward: the step's tokens' routes, split by sequence."""
        routes = torch.stack([info.topk_idx for info in router_infos], dim=1).to("cpu", torch.int16)  # [N, L, k]
        for i, seq in enumerate(batch.seqs):
            rec = self.records.get(seq.request_id)
            if rec is None:
                rec = self.records[seq.request_id] = _Record(self.layers, self.k)
            # a recomputation after preemption redoes the positions past the cache
            rec.length = min(rec.length, seq.num_computed)
            if rec.length < seq.num_computed:
                self._fill_from_blocks(rec, seq)
            rec.append(routes[cu[i]:cu[i + 1]])
            self._register(rec, seq)

    def _hashes(self, rec: _Record, seq, upto: int) -> list[bytes]:
        """The chained hashes of the complete blocks of seq.tokens[:upto] (the prefix cache's), extended in place."""
        b, hashes = self.block, rec.hashes
        for k in range(len(hashes), upto // b):
            hashes.append(block_hash(hashes[k - 1] if k else ROOT_HASH, seq.tokens[k * b:(k + 1) * b], self.extra))
        return hashes

    def _fill_from_blocks(self, rec: _Record, seq) -> None:
        """Positions [rec.length, seq.num_computed) came from the prefix cache: copy their blocks' routes."""
        b = self.block
        hashes = self._hashes(rec, seq, seq.num_computed)
        while rec.length < seq.num_computed:
            k = rec.length // b
            block = self.blocks.get(hashes[k]) if k < len(hashes) else None
            end = min((k + 1) * b, seq.num_computed)
            if block is None:  # not seen under these weights (cannot happen while clear() follows every sync)
                rec.append(torch.full((end - rec.length, self.layers, self.k), -1, dtype=torch.int16))
            else:
                rec.append(block[rec.length - k * b: end - k * b])

    def _register(self, rec: _Record, seq) -> None:
        b = self.block
        done = rec.length // b
        if done <= rec.registered:
            return
        hashes = self._hashes(rec, seq, done * b)
        for k in range(rec.registered, done):
            rows = rec.buf[k * b:(k + 1) * b]
            if hashes[k] not in self.blocks and bool((rows >= 0).all()):
                self.blocks[hashes[k]] = rows.clone()
        rec.registered = done

    def take(self, request_id: str) -> torch.Tensor:
        """The routes [P, L, k] int16 of the positions the engine computed for this request (P = prompt + generated
        − 1 for a finished request: its last sampled token was never run), and forget them."""
        rec = self.records.pop(request_id, None)
        return rec.routes() if rec is not None else torch.empty(0, self.layers, self.k, dtype=torch.int16)

    def clear(self) -> None:
        """After a weight change: block routes of the old weights must not be copied into new requests."""
        self.blocks.clear()


@contextlib.contextmanager
def replayed_routes(model: K3ForCausalLM, routes: torch.Tensor | None):
    """For the forwards inside the block, route token n of the forward's flattened B·T tokens to routes[n, j] in the
    j-th MoE layer (routes [B·T, L, k] int; rows of −1 route as usual). None: nothing replayed."""
    moes = moe_modules(model)
    if routes is None:
        yield
        return
    if routes.dim() != 3 or routes.shape[1] != len(moes):
        raise ValueError(f"routes must be [tokens, {len(moes)} MoE layers, k], got {list(routes.shape)}")
    for j, moe in enumerate(moes):
        moe.replay_topk = routes[:, j]
    try:
        yield
    finally:
        for moe in moes:
            moe.replay_topk = None
