"""The paged decode step: decode-only batches run in place on the pool, captured as CUDA graphs (docs/inference.md).

Legend: N sequences in the step, B ≥ N the padded batch size, M MLA layers, J KDA layers, nb block-table width,
L MoE layers, E experts, k experts per token.

The reference data path (`k3.infer.cache.gather` / `scatter`) copies every scheduled sequence's latents out of the
pool and back each step, which at long context costs more than the attention itself. A step in which every
sequence decodes one token instead calls `K3ForCausalLM.decode_step` on a `K3Cache` of paged views
(`PagedMLALatent` per MLA layer, `PagedKDAState` per KDA layer): the MLA layers write their new latent row into
its page and attend over the pages in place, the KDA layers advance their states in their pool slots.

Static shapes: the batch is padded to one of `graph_batch_sizes`; padding rows decode token 0 against a reserved
scratch page (length 0, every block-table entry and KDA slot pointing at it), and their logits are dropped. The
block tables live on the device, one row per decode slot, and change only where a sequence gained a page (or
was re-admitted), so a step copies N ids, lengths and slot numbers to the device and nothing else. With
`cuda_graphs` each padded size is captured once (after a warm-up that compiles the kernels) and replayed.

Routes (RL routing replay, `k3.posttrain.replay`): given a `route_sink`, a step hands it what `ModelRunner` hands
its own, `(batch, cu, router_infos)` with one token per sequence (cu = 0, 1, …, N) and one `RouterInfo` per MoE
layer holding the N real rows in the batch's order. A graph that reports routes stacks every MoE layer's scores,
cutoffs and top-k into static outputs ([B, L, E], [B, L], [B, L, k]) that each replay overwrites; the step
copies out their first N rows. Those outputs cost B·L·(4E + 4 + 8k) bytes per captured size (≈ 0.34 MB a row
at K3's size), so such graphs are captured only for route-recording steps, beside the plain ones.
"""

from __future__ import annotations

import math

import torch

from k3.infer.cache import PagePool
from k3.infer.scheduler import Batch
from k3.infer.sequence import Sequence
from k3.model.cache import K3Cache, PagedKDAState, PagedMLALatent
from k3.model.model import Collector, K3ForCausalLM
from k3.model.moe import RouterInfo


class PagedDecoder:
    """Runs decode-only batches of up to `max_batch` sequences on the pool in place."""

    def __init__(self, model: K3ForCausalLM, pool: PagePool, max_batch: int, max_context: int,
                 batch_sizes: tuple[int, ...], cuda_graphs: bool):
        spec = pool.spec
        self.model, self.pool, self.spec = model, pool, spec
        self.device = pool.device
        self.sizes = sorted({b for b in batch_sizes if b < max_batch} | {max_batch})
        self.max_batch = max_batch
        self.nb = math.ceil(max_context / spec.page_tokens)
        pages = pool.allocate(1)
        if pages is None:
            raise ValueError("the pool has no page left for the paged decoder's scratch page")
        self.scratch = pages[0]  # never freed: padding rows read and write here
        M, J, dev = len(spec.mla_layers), len(spec.kda_layers), self.device
        # one block-table row per decode slot (a running sequence keeps its slot) and one more, all scratch pages,
        # for padding rows
        self.padding_row = max_batch
        self.tables = torch.full((M, max_batch + 1, self.nb), self.scratch, dtype=torch.int32, device=dev)
        self.slot_of: dict[int, int] = {}  # id(seq) -> decode slot
        self.synced: dict[int, tuple[list, int]] = {}  # slot -> (the seq.blocks list it mirrors, blocks copied)
        self.free_slots = list(range(max_batch - 1, -1, -1))
        # the step's inputs: static device buffers, filled from one pinned host staging buffer per step
        # (columns: token id, cached length, block-table row, then one KDA slot per KDA layer)
        self.ids = torch.zeros(max_batch, 1, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.rows = torch.full((max_batch,), self.padding_row, dtype=torch.long, device=dev)
        self.kda_slots = torch.full((J, max_batch), self.scratch, dtype=torch.long, device=dev)
        self.staging = torch.zeros(max_batch, 3 + J, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.use_graphs = cuda_graphs and dev.type == "cuda"
        # padded size -> (graph, its static logits [B, V]); route_graphs: (graph, logits, its static routes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.route_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple]] = {}
        self.graph_pool = None

    # -- slots and block tables ------------------------------------------------------------------------------

    def release(self, seq: Sequence) -> None:
        """Free the decode slot of a finished or aborted sequence."""
        self._free(id(seq))

    def release_finished(self, running: list[Sequence]) -> None:
        """Free the decode slots of sequences that left the running set (preempted ones, say)."""
        alive = {id(s) for s in running}
        for key in [k for k in self.slot_of if k not in alive]:
            self._free(key)

    def _free(self, key: int) -> None:
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.synced.pop(slot, None)
            self.free_slots.append(slot)

    def _slot(self, seq: Sequence) -> int:
        slot = self.slot_of.get(id(seq))
        if slot is None:
            slot = self.slot_of[id(seq)] = self.free_slots.pop()
        return slot

    def _sync_table(self, seq: Sequence, slot: int, updates: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """Queue the block-table columns of `slot` that differ from `seq.blocks`: the new pages since the last
        step, or the whole row when the sequence's block list was replaced (admission after a preemption)."""
        mirrored, done = self.synced.get(slot, (None, 0))
        if mirrored is not seq.blocks:
            done = 0
        if len(seq.blocks) > self.nb:
            raise ValueError(f"a sequence of {len(seq.blocks)} pages exceeds the decoder's block table ({self.nb})")
        for col in range(done, len(seq.blocks)):
            updates.append((slot, col, seq.blocks[col].pages))
        self.synced[slot] = (seq.blocks, len(seq.blocks))

    # -- the step --------------------------------------------------------------------------------------------

    def padded(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def run(self, seqs: list[Sequence], route_sink=None) -> torch.Tensor:
        """Decode the next token of each sequence (each has exactly one uncomputed token) -> logits [N, V].
        `route_sink`: called as `ModelRunner.route_sink` is, `(batch, cu, router_infos)`, with the experts every MoE
        layer chose for each sequence's token (module docstring); None: routes are not collected."""
        N = len(seqs)
        if not 0 < N <= self.max_batch:
            raise ValueError(f"the paged decoder takes 1 to {self.max_batch} sequences, got {N}")
        B = self.padded(N)
        updates: list[tuple[int, int, tuple[int, ...]]] = []
        rows = [[0, 0, self.padding_row] + [self.scratch] * len(self.spec.kda_layers) for _ in range(B)]
        for i, seq in enumerate(seqs):
            slot = self._slot(seq)
            self._sync_table(seq, slot, updates)
            rows[i] = [seq.tokens[seq.num_computed], seq.num_computed, slot, *(seq.kda_pages or ())]
        if updates:
            slots = torch.tensor([u[0] for u in updates], device=self.device)
            cols = torch.tensor([u[1] for u in updates], device=self.device)
            pages = torch.tensor([u[2] for u in updates], dtype=torch.int32, device=self.device).t()  # [M, U]
            self.tables[:, slots, cols] = pages
        staged = self.staging[:B]
        staged.copy_(torch.tensor(rows, dtype=torch.long))
        # the pinned buffer is rewritten next step only after this step's tokens were read back (a sync)
        self._load(staged.to(self.device, non_blocking=True))
        routes = route_sink is not None
        if not self.use_graphs:
            width = math.ceil((max(s.num_computed for s in seqs) + 1) / self.spec.page_tokens)
            logits, stacked = self._forward(B, width, routes)
        else:
            graphs = self.route_graphs if routes else self.graphs
            if B not in graphs:
                self._capture(B, routes)
            graph, logits, *stacked = graphs[B]
            graph.replay()
            stacked = stacked[0] if routes else None
        if routes:
            # in inference mode, as the runner calls the sink (a recorder's buffers are inference tensors then)
            with torch.inference_mode():
                # copies of the real rows: a graph's next replay overwrites its static outputs
                scores, cutoff, topk = (t[:N].clone() for t in stacked)
                infos = [RouterInfo(scores[:, j], cutoff[:, j], topk[:, j]) for j in range(topk.shape[1])]
                route_sink(Batch(list(seqs), [1] * N), list(range(N + 1)), infos)
        return logits[:N]

    def _load(self, inputs: torch.Tensor) -> None:
        """inputs [B, 3 + J] on the device -> the first B rows of the static input buffers."""
        B = inputs.shape[0]
        self.ids[:B, 0] = inputs[:, 0]
        self.lengths[:B] = inputs[:, 1].to(torch.int32)
        self.rows[:B] = inputs[:, 2]
        self.kda_slots[:, :B] = inputs[:, 3:].t()

    def _forward(self, B: int, width: int | None = None, routes: bool = False) -> tuple[torch.Tensor, tuple | None]:
        """The step on the first B rows -> (logits [B, V], with `routes` the router infos stacked over the MoE
        layers: scores [B, L, E], cutoff [B, L], topk_idx [B, L, k]; else None)."""
        spec = self.spec
        cache = K3Cache(spec.num_layers, B)
        tables = self.tables[:, self.rows[:B]]  # [M, B, nb]: gathered on the device
        if width is not None:
            tables = tables[:, :, :width]
        for j, layer in enumerate(spec.mla_layers):
            cache.layers[layer] = PagedMLALatent(self.pool.mla, tables[j], self.lengths[:B])
        for j, layer in enumerate(spec.kda_layers):
            cache.layers[layer] = PagedKDAState(self.pool.kda_state, self.pool.kda_conv, self.kda_slots[j, :B])
        infos = Collector() if routes else None
        with torch.inference_mode():
            logits = self.model.decode_step(self.ids[:B], cache, infos)
            self.pool.arena[self.scratch].zero_()  # padding rows leave nothing behind
            stacked = None
            if routes:  # one copy out per step instead of three per MoE layer
                stacked = tuple(torch.stack([getattr(i, name) for i in infos], dim=1)
                                for name in ("scores", "cutoff", "topk_idx"))
        return logits, stacked

    def _capture(self, B: int, routes: bool) -> None:
        """Capture the step at padded size B (reporting routes or not). The warm-up (kernel compilation,
        autotuning; on a side stream, as torch.cuda.graphs asks) really runs, so it runs on padding rows only; the
        capture itself runs nothing."""
        real = torch.cat([self.ids[:B], self.lengths[:B, None].long(), self.rows[:B, None],
                          self.kda_slots[:, :B].t()], dim=1)
        padding = torch.zeros_like(real)
        padding[:, 2] = self.padding_row
        padding[:, 3:] = self.scratch
        self._load(padding)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(B, routes=routes)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._load(real)
        graph = torch.cuda.CUDAGraph()
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            logits, stacked = self._forward(B, routes=routes)
        if routes:
            self.route_graphs[B] = (graph, logits, stacked)
        else:
            self.graphs[B] = (graph, logits)
