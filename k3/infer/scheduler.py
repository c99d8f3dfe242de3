"""Continuous batching: waiting and running queues, a per-step token budget, chunked prefill, admission to
the running batch with prefix-cache hits, and preemption by recompute (docs/inference.md).

Each step:
1. every running request with one token left to run (a decode, or the last prompt token) gets it;
2. running requests still prefilling get the next piece of their prompt, oldest first, while the token
   budget lasts — so a long prompt is spread over steps and never stalls the decodes;
3. waiting requests are admitted (prefix lookup, pin, CPU-pool load, copy-on-write, private KDA state)
   while sequence slots, the budget and free pages last.

A prefill piece ends at the prompt end or on a hash boundary: at the next multiple of the prefill chunk,
of the KDA checkpoint interval (N hash blocks), at the prompt's last hash boundary before its final token
(where the end-of-prompt checkpoint is taken), or where the budget runs out (rounded down to a hash
boundary). Piece boundaries are absolute positions, so two runs of one prompt split it identically.

When a request needs a page and none can be freed, the newest running request (long class first) is
preempted: its pages are released (what it registered stays in the prefix cache), it goes back to the
front of the waiting queue and is recomputed when readmitted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from k3.infer.cache import CacheSpec, PagePool
from k3.infer.config import EngineConfig
from k3.infer.metrics import EngineMetrics
from k3.infer.prefix_cache import MLABlock, PrefixCache, extend_hashes
from k3.infer.sequence import Sequence, SequenceStatus


@dataclass
class Batch:
    seqs: list[Sequence] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # tokens run per sequence this step

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.counts.append(n)

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, spec: CacheSpec, pool: PagePool, prefix: PrefixCache,
                 metrics: EngineMetrics, media: dict | None = None):
        self.config = config
        self.spec = spec
        self.pool = pool
        self.prefix = prefix
        self.metrics = metrics
        self.media = media if media is not None else {}  # request id -> RequestMedia: images in the block hashes
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.n_mla = len(spec.mla_layers)
        self.n_kda = len(spec.kda_layers)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a request out of the queues and release everything it holds (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        for block in seq.blocks:
            self.pool.decref(block.pages)
        seq.blocks = []
        if seq.kda_pages is not None:
            self.pool.decref(seq.kda_pages)
            seq.kda_pages = None
        seq.num_computed = 0
        seq.draft_tokens, seq.draft_probs = [], None
        seq.decode_checkpoint = None  # a decode checkpoint left behind stays cached like any other
        seq.num_registered = 0

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.metrics.inc("preemptions_total")

    def schedule(self) -> Batch:
        budget = self.config.max_step_tokens
        batch = Batch()
        preempted = self.metrics.counters["preemptions_total"]
        for seq in list(self.running):
            if seq.remaining == 1 and budget >= 1 and seq in self.running:
                # a decode verifies its drafts in the same piece (speculative decoding): as many as the budget takes
                if len(seq.draft_tokens) > budget - 1:
                    seq.draft_tokens = seq.draft_tokens[: budget - 1]
                spec = len(seq.draft_tokens)
                if self._ensure_pages(seq, seq.num_computed + 1 + spec, batch):
                    batch.add(seq, 1)
                    budget -= 1 + spec
        for seq in list(self.running):
            if seq.remaining > 1 and seq in self.running and seq not in batch.seqs:
                n = self._piece(seq, budget)
                if n and self._ensure_pages(seq, seq.num_computed + n, batch):
                    batch.add(seq, n)
                    budget -= n
        # no admissions in a step that had to preempt: the pool is full, and readmitting would thrash
        while (self.waiting and len(self.running) < self.config.max_running and budget > 0
               and self.metrics.counters["preemptions_total"] == preempted):
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            self.running.append(seq)
            n = self._piece(seq, budget)
            if not n or not self._ensure_pages(seq, seq.num_computed + n, batch):
                break
            batch.add(seq, n)
            budget -= n
        return batch

    def _piece(self, seq: Sequence, budget: int) -> int:
        """How many of the request's remaining tokens to run this step (0: none fit)."""
        start, total = seq.num_computed, len(seq.tokens)
        if total - start == 1:
            return 1 if budget >= 1 else 0
        b, C = self.spec.hash_block, self.config.prefill_chunk_tokens
        end = min(total, start + budget, (start // C + 1) * C)
        if self.prefix.enabled:
            every = self.config.checkpoint_every_blocks * b
            end = min(end, (start // every + 1) * every)
            target = (total - 1) // b * b  # the end-of-prompt checkpoint: last hash boundary before the last token
            if start < target < end:
                end = target
        if end < total:
            end = end // b * b
        return max(0, end - start)

    def _ensure_pages(self, seq: Sequence, upto: int, batch: Batch) -> bool:
        """Give `seq` MLA pages for `upto` tokens, preempting others if needed. False if `seq` itself
        had to be preempted."""
        pt = self.spec.page_tokens
        while len(seq.blocks) * pt < upto:
            pages = self.prefix.allocate(self.n_mla)
            if pages is not None:
                seq.blocks.append(MLABlock(tuple(pages), len(seq.blocks)))
                continue
            # the newest running request not already in this step's batch, long ones first (maybe seq itself)
            order = {id(s): i for i, s in enumerate(self.running)}
            candidates = [s for s in self.running if s is seq or all(s is not b for b in batch.seqs)]
            victim = max(candidates, key=lambda s: (s.long, order[id(s)]))
            if victim is seq:
                assert len(self.running) > 1 or batch.seqs, "the pool cannot hold one request of max_context"
                self.preempt(seq)
                return False
            self.preempt(victim)
        return True

    def _admit(self, seq: Sequence) -> bool:
        """Move a waiting request's state into the pool: prefix hit (pinned, loaded, CoW) and private KDA
        pages. False (nothing held) if the pool cannot take it now."""
        prefix, pool = self.prefix, self.pool
        need = self.n_kda + 2 * self.n_mla
        if self.running and prefix.reclaimable() < need + self.n_mla * len(self.running):
            return False  # keep room for the running requests' next pages
        first = not seq.admitted_once
        hit = None
        if prefix.enabled:
            extend_hashes(seq.hashes, seq.tokens, self.spec.hash_block, prefix.extra, self.media.get(seq.request_id))
            hit = prefix.lookup(seq.hashes, len(seq.tokens) - 1)
        acquired = prefix.acquire(hit) if hit is not None else None
        if hit is not None and acquired is None:
            hit = prefix.lookup(seq.hashes, len(seq.tokens) - 1, use_host=False)
            acquired = prefix.acquire(hit) if hit is not None else None
        blocks, ck = acquired if acquired is not None else ([], None)
        kda_pages = prefix.allocate(self.n_kda)
        if kda_pages is None:
            for blk in blocks:
                pool.decref(blk.pages)
            if ck is not None:
                pool.decref(ck.pages)
            return False
        n_hit = hit.num_tokens if acquired is not None else 0
        pt = self.spec.page_tokens
        if n_hit % pt:
            # (d) copy-on-write: the hit ends inside a shared page; this request writes after it
            pages = prefix.allocate(self.n_mla)
            if pages is None:
                for blk in blocks:
                    pool.decref(blk.pages)
                if ck is not None:
                    pool.decref(ck.pages)
                pool.decref(kda_pages)
                return False
            shared = blocks[-1]
            pool.copy(pages, shared.pages)
            pool.decref(shared.pages)
            blocks[-1] = MLABlock(tuple(pages), shared.index)
        if ck is not None:
            pool.copy(kda_pages, ck.pages)
            pool.decref(ck.pages)
        else:
            pool.zero(kda_pages)
        seq.blocks, seq.kda_pages, seq.num_computed = blocks, kda_pages, n_hit
        # endpoints up to the hit are registered already (by whoever wrote them)
        seq.num_registered = n_hit // self.spec.hash_block
        seq.status = SequenceStatus.RUNNING
        if first:
            seq.admitted_once = True
            seq.cached_tokens = n_hit
            if prefix.enabled:
                self.metrics.inc("prefix_query_requests_total")
                self.metrics.inc("prefix_queries_total", len(seq.prompt_ids))
                if n_hit:
                    self.metrics.inc("prefix_hit_requests_total")
                    self.metrics.inc("prefix_hits_total", n_hit)
                    if hit.host_tokens:
                        self.metrics.inc("cpu_pool_hit_tokens_total", n_hit)
        return True

    def after_forward(self, seq: Sequence, n: int, decoding: bool | None = None) -> None:
        """Advance `seq` by the n tokens just written, index the hash blocks it completed, and save a KDA
        checkpoint if its new length is a checkpoint position. `decoding`: the n tokens are verified output
        (speculative decoding advances a decode by several); None: a one-token step at the end of `tokens`."""
        start = seq.num_computed
        seq.num_computed += n
        if not self.prefix.enabled:
            return
        b, pt = self.spec.hash_block, self.spec.page_tokens
        extend_hashes(seq.hashes, seq.tokens, b, self.prefix.extra, self.media.get(seq.request_id))
        done = seq.num_computed // b
        for k in range(seq.num_registered, done):
            end = (k + 1) * b
            block = seq.blocks[(end - 1) // pt]
            self.prefix.register_endpoint(block, seq.hashes[k], end - block.index * pt)
        seq.num_registered = max(seq.num_registered, done)
        pos = seq.num_computed
        if pos % b or not self.n_kda:
            return
        total = len(seq.tokens)
        if decoding is None:
            decoding = n == 1 and start == total - 1 and seq.output_ids
        h = seq.hashes[pos // b - 1]
        if decoding:
            ck = self.prefix.save_checkpoint(seq.kda_pages, h, pos)
            if ck is not None or self.prefix.gpu_checkpoint(h) is not None:
                # a later boundary is checkpointed: this request's previous decode checkpoint is a
                # superseded intermediate (a checkpoint somebody else made is never recycled here)
                if seq.decode_checkpoint is not None:
                    self.prefix.drop_checkpoint(seq.decode_checkpoint)
                seq.decode_checkpoint = ck
        else:
            every = self.config.checkpoint_every_blocks * b
            if pos % every == 0 or pos == (total - 1) // b * b or pos == total:
                self.prefix.save_checkpoint(seq.kda_pages, h, pos)
