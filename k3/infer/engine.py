"""The inference engine: requests in token ids, continuous batching over the hybrid paged cache (docs/inference.md).

    add_request ─► Scheduler (waiting → running, budgets, chunked prefill, preemption)
                   │  Batch: N sequences × their next pieces
                   ▼
    ModelRunner: gather pages → K3Cache ─► model(ragged packed step) ─► scatter back; last-position logits
                   ▼
    Scheduler.after_forward (index hash blocks, save KDA checkpoints) ─► sampling ─► stop checks ─► RequestOutput

Grammar-constrained requests (`SamplingParams.grammar`, `k3.infer.grammar`) keep a matcher per sequence; the
bitmask of the rows that sample this step is filled in a worker thread while the forward pass runs, applied
by the sampler, and each matcher then consumes its accepted token.

Requests may carry images (`MediaInput`s, k3/infer/media.py): the runner splices their projector rows over the
prompt's `<|media_pad|>` tokens, encoding each distinct image once (cached by content key, which also keys the
prefix cache); the encoder comes from above (the model's `encode_media`), so this package never imports vision.

With a drafter (`EngineConfig.speculative_tokens` > 0, docs/speculative.md) `step` hands the batch to
`speculative_step` (k3/infer/speculative_step.py) in place of its decode step: decodes verify their drafted tokens in
the same ragged pass, accept exactly, roll their KDA states back to the last verified position, and the drafter
drafts the next ones.

The engine knows no text: token ids in, token ids and logprobs out. Detokenization and stop strings live
above it (`k3.chat.detokenize`), shared by the server, the CLI and evaluation.

`Engine` is synchronous and single-threaded; `AsyncEngine` runs it in a background thread and streams
outputs to asyncio consumers (what the server uses). Split after nano-vllm: sequence.py, scheduler.py,
cache.py (the pool), prefix_cache.py, kv_pool.py, sampling.py, metrics.py, speculative_step.py; the runner is below.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import random
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from k3.infer.api import (
    AdmissionError,
    ContextLengthError,
    MediaInput,
    RequestOutput,
    RequestTooLargeError,
    SamplingParams,
)
from k3.infer.cache import CacheSpec, PagePool, gather, scatter
from k3.infer.config import EngineConfig
from k3.infer.decode import PagedDecoder
from k3.infer.grammar import fill_bitmask, unpack_bitmask
from k3.infer.kv_pool import HostKVPool
from k3.infer.media import MediaCache, RequestMedia, media_key
from k3.infer.metrics import EngineMetrics
from k3.infer.prefix_cache import PrefixCache
from k3.infer.sampling import sample
from k3.infer.scheduler import Batch, Scheduler
from k3.infer.sequence import Sequence, SequenceStatus
from k3.infer.speculative import Drafter
from k3.infer.speculative_step import speculative_step
from k3.model.model import K3ForCausalLM


class ModelRunner:
    """One engine step on the model: pages → K3Cache → ragged forward → pages; returns last-position logits."""

    def __init__(self, model: K3ForCausalLM, pool: PagePool, media_cache: MediaCache | None = None,
                 media: dict[str, RequestMedia] | None = None):
        self.model = model
        self.pool = pool
        self.device = pool.device
        # RL routing replay (k3.posttrain.replay) sets this: called after each forward with (batch, cu_seqlens,
        # router_infos), the experts every MoE layer chose for each token of the step
        self.route_sink = None
        # a multimodal model's image rows (k3.infer.media): the cache, and each request's images by request id
        self.media_cache = media_cache
        self.media = media if media is not None else {}
        self.pad_id = model.config.media_placeholder_token_id

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """-> logits [N, V] at the last new token of each scheduled sequence."""
        ids, cu = [], [0]
        for seq, n in zip(batch.seqs, batch.counts):
            ids.extend(seq.tokens[seq.num_computed : seq.num_computed + n])
            cu.append(cu[-1] + n)
        blocks = [s.blocks for s in batch.seqs]
        kda = [s.kda_pages for s in batch.seqs]
        lengths = [s.num_computed for s in batch.seqs]
        cache = gather(self.pool, blocks, kda, lengths)
        cu_t = torch.tensor(cu, device=self.device)
        media = self.media_inputs(batch, ids) if self.media_cache is not None else {}
        out = self.model(torch.tensor(ids, device=self.device)[None], cu_seqlens=cu_t, cache=cache,
                         logits_at=cu_t[1:] - 1, return_router_infos=self.route_sink is not None, **media)
        scatter(self.pool, cache, blocks, kda, lengths, batch.counts)
        if self.route_sink is not None:
            self.route_sink(batch, cu, out.router_infos)
        return out.logits

    def media_inputs(self, batch: Batch, ids: list[int]) -> dict[str, torch.Tensor]:
        """A multimodal model's `media_rows` [M, D] and `media_mask` [1, N] for this step: the rows of the prompt
        pads its pieces run (the tower runs here for images not cached yet). A `<|media_pad|>` the model generated
        is no image: the mask leaves it a plain token. {} when the step holds no pad at all."""
        step = self.media_cache.step_inputs([(self.media.get(s.request_id), s.num_computed, n)
                                             for s, n in zip(batch.seqs, batch.counts)])
        if step is None and self.pad_id not in ids:
            return {}
        if step is None:
            step = torch.zeros(0, self.model.config.hidden_size, device=self.device), [False] * len(ids)
        rows, flags = step
        return {"media_rows": rows, "media_mask": torch.tensor(flags, device=self.device)[None]}

    def runs_media(self, batch: Batch) -> bool:
        """Does this step run a prompt pad of an image (then it cannot be a paged decode step)."""
        return any(self.media[s.request_id].spans(s.num_computed, s.num_computed + n)
                   for s, n in zip(batch.seqs, batch.counts) if s.request_id in self.media)


class Engine:
    """Continuous-batching engine over one model. Not thread-safe (see AsyncEngine)."""

    def __init__(self, model: K3ForCausalLM, config: EngineConfig | None = None, media_encoder=None,
                 drafter: Drafter | None = None):
        """`media_encoder`: `(pixel_values [N, 3, p, p], grid_thw [n, 3]) → rows [M, D]` for requests with images
        (default: the model's `encode_media`, which a `K3VisionLanguageModel` has); without one the engine is
        text-only and refuses media. `drafter`: the draft model for speculative decoding (`config.speculative_tokens`
        > 0; k3.spec.drafter.DraftRunner implements it), docs/speculative.md."""
        config = config or EngineConfig()
        config.validate()
        if config.speculative_tokens and drafter is None:
            raise ValueError("speculative_tokens > 0 needs a drafter (k3 serve/generate --draft DIR)")
        self.drafter = drafter if config.speculative_tokens else None
        self.model = model.eval()
        mcfg = model.config
        self.vocab_size = mcfg.vocab_size
        device = next(model.parameters()).device
        dtype = model.model.embed_tokens.weight.dtype
        self.spec = spec = CacheSpec.build(mcfg, config.hash_block_size, dtype, config.page_tokens)
        n_mla, n_kda = len(spec.mla_layers), len(spec.kda_layers)
        paged = config.decode_path == "paged" or (config.decode_path == "auto" and device.type == "cuda")
        # the verify pass runs k + 1 tokens per sequence and hands out features: the gather path
        paged = paged and self.drafter is None
        pool_bytes = config.pool_bytes
        if pool_bytes is None:
            pool_bytes = torch.cuda.mem_get_info(device)[0] // 2 if device.type == "cuda" else 256 * 2**20
        num_pages = config.num_pages or pool_bytes // spec.page_bytes
        # the pool must hold one request of the context limit (plus a copy-on-write page): then preemption
        # can always make room and no request that passed the context check ever fails
        fit = (num_pages - paged - n_kda - n_mla) // n_mla * spec.page_tokens  # paged: minus its scratch page
        if fit < 2:
            raise ValueError(f"a pool of {num_pages} pages of {spec.page_bytes} B cannot hold one request "
                             f"(needs {n_kda + 2 * n_mla} pages at least); raise pool_bytes / num_pages")
        max_context = min(config.max_context or mcfg.max_position_embeddings, mcfg.max_position_embeddings, fit)
        # default class budgets (admission charges prompt + max_tokens, a worst case): short requests may
        # book twice the tokens the pool holds, long ones what it holds (at least one max_context request)
        capacity = fit
        self.config = config.replace(
            page_tokens=spec.page_tokens, pool_bytes=num_pages * spec.page_bytes, num_pages=num_pages,
            max_context=max_context,
            short_budget_tokens=config.short_budget_tokens or max(2 * capacity, config.long_request_tokens),
            long_budget_tokens=config.long_budget_tokens or max(capacity, max_context),
            eos_token_ids=(config.eos_token_ids if config.eos_token_ids is not None else (mcfg.eos_token_id,)),
        )
        self.max_context = max_context
        self.pool = PagePool(spec, num_pages, device)
        host = None
        if config.cpu_pool_bytes:
            host = HostKVPool(config.cpu_pool_bytes // spec.page_bytes, spec.page_bytes, self.pool.device)
        self.host_pool = host
        self.metrics_state = EngineMetrics()
        self.prefix = PrefixCache(self.pool, config.enable_prefix_caching, config.checkpoint_every_blocks,
                                  config.model_id, host)
        encoder = media_encoder if media_encoder is not None else getattr(model, "encode_media", None)
        self.media_cache = MediaCache(encoder, config.media_cache_bytes) if encoder is not None else None
        if self.drafter is not None and self.media_cache is not None:
            raise ValueError("speculative decoding is text-only: a model with a vision tower takes no drafter")
        # accepted / drafted counts by draft position (speculative decoding)
        self.spec_position_accepted = [0] * config.speculative_tokens
        self.spec_position_drafted = [0] * config.speculative_tokens
        self.media: dict[str, RequestMedia] = {}  # the images of the requests that have some, by request id
        self.media_pad_id = mcfg.media_placeholder_token_id
        self.scheduler = Scheduler(self.config, spec, self.pool, self.prefix, self.metrics_state, self.media)
        self.runner = ModelRunner(model, self.pool, self.media_cache, self.media)
        # decode-only steps in place on the pool (k3.infer.decode); built after the pool so its scratch page
        # is the pool's first
        self.decoder = PagedDecoder(model, self.pool, config.max_running, max_context, config.graph_batch_sizes,
                                    config.cuda_graphs) if paged else None
        self.requests: dict[str, Sequence] = {}
        self._outstanding = {False: 0, True: 0}  # admitted budget tokens per class (long?)
        self._count = {False: 0, True: 0}
        self._seed_rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._mask_worker: ThreadPoolExecutor | None = None

    @property
    def accepts_media(self) -> bool:
        """Requests may carry images (the model has a vision tower)."""
        return self.media_cache is not None

    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams | None = None,
                    media: list[MediaInput] | None = None) -> None:
        """Queue a request. `media`: its images in the order of their `<|media_pad|>` runs (default: a
        `MediaPrompt`'s own). Raises ValueError (bad input), ContextLengthError (prompt + max_tokens over the
        context limit) or AdmissionError (over the class budget: retry after `retry_after` seconds)."""
        media = media if media is not None else getattr(prompt_ids, "media", None)
        sampling = sampling or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("prompt_ids: the prompt must hold at least one token")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt_ids: token ids must be ints in [0, {self.vocab_size})")
        sampling.validate(self.vocab_size)
        request_media = None
        if media and self.media_cache is None:
            raise ValueError("media: this model is text-only (it has no vision tower): it takes no images")
        if self.media_cache is not None and (media or self.media_pad_id in prompt_ids):
            request_media = RequestMedia.build(prompt_ids, media or [], self.media_pad_id)
        total = len(prompt_ids) + sampling.max_tokens
        if total > self.max_context:
            raise ContextLengthError(
                f"this engine's context limit is {self.max_context} tokens, but the request needs "
                f"{total} ({len(prompt_ids)} prompt + {sampling.max_tokens} max_tokens)")
        self.check_admissible([total])
        long = total >= self.config.long_request_tokens
        budget = self.config.long_budget_tokens if long else self.config.short_budget_tokens
        max_requests = self.config.long_max_requests if long else self.config.short_max_requests
        if self._outstanding[long] + total > budget or self._count[long] >= max_requests:
            self.metrics_state.inc("admission_rejections_total")
            raise AdmissionError(
                f"the engine is at its {'long' if long else 'short'}-request budget "
                f"({self._count[long]} requests, {self._outstanding[long]} of {budget} tokens); retry later",
                retry_after=self._retry_after(self._outstanding[long] + total - budget), status=503)
        seed = sampling.seed if sampling.seed is not None else self._seed_rng.getrandbits(63)
        gen = torch.Generator(device=self.pool.device).manual_seed(seed)
        seq = Sequence(request_id, prompt_ids, sampling, gen, long=long)
        self.requests[request_id] = seq
        if request_media is not None:
            self.media[request_id] = request_media
        self._outstanding[long] += total
        self._count[long] += 1
        self.scheduler.add(seq)

    def check_admissible(self, totals: list[int]) -> None:
        """Raise RequestTooLargeError when requests of these budgets (prompt + max_tokens each; the n choices of
        one API call) could not all be admitted even by an idle engine, so that retrying is pointless."""
        cfg = self.config
        for long in (False, True):
            mine = [t for t in totals if (t >= cfg.long_request_tokens) == long]
            budget = cfg.long_budget_tokens if long else cfg.short_budget_tokens
            max_requests = cfg.long_max_requests if long else cfg.short_max_requests
            kind = "long" if long else "short"
            if sum(mine) > budget:
                raise RequestTooLargeError(
                    f"these {len(mine)} {kind} requests need {sum(mine)} tokens (prompt + max_tokens each) but the "
                    f"engine admits at most {budget} tokens of {kind} requests at once; lower n or max_tokens")
            if len(mine) > max_requests:
                raise RequestTooLargeError(f"{len(mine)} {kind} requests at once exceed the engine's limit of "
                                           f"{max_requests}; lower n")

    def _retry_after(self, excess_tokens: int) -> float:
        rate, _ = self.metrics_state.rates()
        est = max(excess_tokens, 1) / rate if rate > 0 else 1.0
        return float(min(60.0, max(1.0, math.ceil(est))))

    def abort(self, request_id: str) -> bool:
        """Drop a request and free every page and slot it holds. False if it is unknown or finished."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        self.scheduler.remove(seq)
        if self.decoder is not None:
            self.decoder.release(seq)
        if self.drafter is not None:
            self.drafter.release(seq.request_id)
        del self.requests[seq.request_id]
        self.media.pop(seq.request_id, None)
        self._outstanding[seq.long] -= seq.budget_tokens
        self._count[seq.long] -= 1
        self.metrics_state.inc("requests_finished_total")
        self.metrics_state.observe("e2e_request_latency_seconds", time.monotonic() - seq.arrival)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def export_sequence(self, request_id: str):
        """A running request's cache after its prefill, to continue elsewhere (`k3.infer.transfer`)."""
        from k3.infer.transfer import export_sequence

        return export_sequence(self, request_id)

    def add_prefilled(self, state, arrival: float | None = None) -> RequestOutput:
        """Admit a request prefilled elsewhere and decode it without recomputing its prompt (`k3.infer.transfer`);
        returns the prefill side's first output."""
        from k3.infer.transfer import add_prefilled

        return add_prefilled(self, state, arrival)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a full state dict (the model's names; any dtype or device) into the engine's model in place and drop
        every cached prefix, whose pages hold the old weights' keys and states. How RL hands the trainer's weights to
        its rollout engine each iteration (k3.posttrain.rollout). Needs an idle engine: a running request's cache
        would mix the two models."""
        if self.has_unfinished():
            raise ValueError("load_weights needs an idle engine: finish or abort its requests first")
        with torch.no_grad():
            self.model.load_state_dict(tensors)
        self.clear_prefix_cache()
        if self.media_cache is not None:
            self.media_cache.clear()  # image rows are the old weights' too

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix, on the device and in the CPU pool (an idle engine: no page is in use)."""
        if self.has_unfinished():
            raise ValueError("clear_prefix_cache needs an idle engine: finish or abort its requests first")
        for block in list(self.prefix.lru):
            self.prefix.evict(block, write_back=False)
        if self.host_pool is not None:
            self.host_pool.clear()

    def step(self) -> list[RequestOutput]:
        """Run one forward over the scheduled pieces; return what each request produced (new tokens, or
        its finish). Requests still prefilling produce nothing."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        self._note_admissions(batch)
        if self.drafter is not None:  # decodes verify their drafts instead (k3/infer/speculative_step.py)
            return speculative_step(self, batch)
        m = self.metrics_state
        ready = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.counts))
                 if seq.num_computed + n == len(seq.tokens)]
        masks = self._grammar_masks([batch.seqs[i] for i in ready])
        if (self.decoder is not None and len(ready) == len(batch.seqs) and max(batch.counts) == 1
                and not self.runner.runs_media(batch)):
            self.decoder.release_finished(self.scheduler.running)
            logits = self.decoder.run(batch.seqs, self.runner.route_sink)
        else:
            logits = self.runner.run(batch)
        for seq, n in zip(batch.seqs, batch.counts):
            self.scheduler.after_forward(seq, n)
        outputs = []
        if ready:
            seqs = [batch.seqs[i] for i in ready]
            tokens, logprobs = self._sample(seqs, logits[ready], masks)
            now = time.monotonic()
            outputs = [self._append(seq, tok, lp, now) for seq, tok, lp in zip(seqs, tokens, logprobs)]
        m.inc("steps_total")
        m.inc("forward_tokens_total", batch.num_tokens)
        m.inc("generation_tokens_total", len(ready))
        m.record_step(len(ready), batch.num_tokens)
        return outputs

    def _grammar_masks(self, seqs: list[Sequence]) -> Future | None:
        """Start filling the grammar bitmasks of the sequences that sample this step, in a worker thread while the
        forward runs (they are known before it); None when none of them is constrained."""
        if not any(s.matcher is not None for s in seqs):
            return None
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="k3-grammar")
        return self._mask_worker.submit(fill_bitmask, [s.matcher for s in seqs], self.vocab_size)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, masks: Future | None) -> tuple[list[int], list]:
        """One token per sequence from logits [n, V], under their grammar masks (`_grammar_masks`); each matcher
        consumes its token. -> (tokens, logprobs)."""
        allowed = None if masks is None else unpack_bitmask(masks.result().to(logits.device), self.vocab_size)
        tokens, logprobs = sample(logits, [s.sampling for s in seqs], [s.generator for s in seqs],
                                  [s.prompt_ids for s in seqs], [s.output_ids for s in seqs], allowed)
        for seq, tok in zip(seqs, tokens):
            if seq.matcher is not None:
                accepted = seq.matcher.consume_token(tok)
                assert accepted, f"the grammar refused a token its own mask allowed: {seq.matcher.get_error()}"
        return tokens, logprobs

    def _note_admissions(self, batch: Batch) -> None:
        m = self.metrics_state
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.admit_time is None:
                seq.admit_time = now
                m.observe("queue_time_seconds", now - seq.arrival)
                m.inc("prompt_tokens_total", seq.num_prompt)

    def _append(self, seq: Sequence, token: int, lp, now: float) -> RequestOutput:
        self._record(seq, [token], [lp], now)
        return self._output(seq)

    def _record(self, seq: Sequence, tokens: list[int], lps: list, now: float) -> None:
        """Append generated tokens (one, or a verify step's several) to `seq`."""
        m = self.metrics_state
        if seq.first_token_time is None:
            seq.first_token_time = now
            m.observe("time_to_first_token_seconds", now - seq.arrival)
        else:
            for _ in tokens:  # a verify step's tokens arrive together: the gap is shared
                m.observe("inter_token_latency_seconds", (now - seq.last_token_time) / len(tokens))
        seq.last_token_time = now
        seq.tokens.extend(tokens)
        seq.output_ids.extend(tokens)
        seq.pending_logprobs.extend(lp for lp in lps if lp is not None)

    def _stop_reason(self, seq: Sequence, token: int, n_output: int, n_tokens: int) -> str | None:
        """Why a request ends after `token` (its n_output-th output token, n_tokens in all), or None."""
        sp = seq.sampling
        if token in sp.stop_token_ids or token in self.config.eos_token_ids:
            return "stop"
        if seq.matcher is not None and seq.matcher.is_stopped():
            return "stop"  # the grammar is complete: nothing more may follow
        if n_output >= sp.max_tokens or n_tokens >= self.max_context:
            return "length"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        """The output increment after the tokens just recorded; finishes the request on a stop."""
        sp = seq.sampling
        reason = self._stop_reason(seq, seq.output_ids[-1], len(seq.output_ids), len(seq.tokens))
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.output_ids[seq.emitted_tokens :],
            logprobs=seq.pending_logprobs if sp.logprobs is not None else None,
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=seq.num_prompt,
            cached_tokens=seq.cached_tokens,
            completion_tokens=len(seq.output_ids),
            accepted_prediction_tokens=seq.accepted_tokens,
            rejected_prediction_tokens=seq.rejected_tokens,
        )
        seq.emitted_tokens = len(seq.output_ids)
        seq.pending_logprobs = []
        if reason is not None:
            self._finish(seq, reason)
        return out

    def metrics(self) -> dict:
        """A snapshot for `render_prometheus` (plain numbers and histogram dicts)."""
        snap = self.metrics_state.snapshot()
        pool = self.pool
        cached = self.prefix.cached_pages()
        used = pool.num_pages - pool.num_free - cached
        waiting = len(self.scheduler.waiting)
        snap.update(
            requests_running=len(self.scheduler.running),
            requests_waiting=waiting,
            kv_pages_total=pool.num_pages,
            kv_pages_used=used,
            kv_pages_cached=cached,
            kv_pages_free=pool.num_free,
            kv_utilization=used / pool.num_pages,
            kda_slots_used=len(self.scheduler.running),
            kda_slots_total=self.config.max_running,
            prefix_evictions_total=self.prefix.evictions,
        )
        host = self.host_pool
        snap.update(
            cpu_pool_hits_total=host.loads if host else 0,
            cpu_pool_bytes_out_total=host.bytes_out if host else 0,
            cpu_pool_bytes_in_total=host.bytes_in if host else 0,
            cpu_pool_slots_used=host.used_slots if host else 0,
            cpu_pool_slots_total=host.num_slots if host else 0,
        )
        if self.drafter is None:  # speculative decoding off: its metrics are absent, not zero (the dashboard says so)
            for name in [n for n in snap if n.startswith("spec_")]:
                del snap[name]
        else:
            c = snap
            snap.update(spec_acceptance_rate=c["spec_accepted_tokens_total"] / max(c["spec_draft_tokens_total"], 1),
                        spec_tokens_per_verify=c["spec_emitted_tokens_total"] / max(c["spec_verifies_total"], 1))
        media = self.media_cache
        snap.update(media_items_encoded_total=media.encoded if media else 0,
                    media_cache_hits_total=media.hits if media else 0, media_cache_bytes=media.bytes if media else 0)
        return snap

    def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
                 media: list[MediaInput] | None = None) -> RequestOutput:
        """Run one request to completion on an otherwise idle engine; returns all its tokens in one output."""
        if self.has_unfinished():
            raise ValueError("generate() needs an idle engine; use add_request/step with other requests queued")
        sampling = sampling or SamplingParams()
        rid = f"generate-{next(self._ids)}"
        self.add_request(rid, prompt_ids, sampling, media)
        total = RequestOutput(rid, [], logprobs=[] if sampling.logprobs is not None else None)
        while True:
            for out in self.step():
                merge_output(total, out)
            if total.finished:
                return total


def merge_output(total: RequestOutput, out: RequestOutput) -> None:
    """Accumulate a streamed increment into a running total (in place)."""
    total.new_token_ids = total.new_token_ids + out.new_token_ids
    if out.logprobs is not None:
        total.logprobs = (total.logprobs or []) + out.logprobs
    total.finished, total.finish_reason = out.finished, out.finish_reason
    total.prompt_tokens, total.cached_tokens = out.prompt_tokens, out.cached_tokens
    total.completion_tokens = out.completion_tokens
    total.accepted_prediction_tokens = out.accepted_prediction_tokens
    total.rejected_prediction_tokens = out.rejected_prediction_tokens


class AsyncEngine:
    """`Engine` in a background thread, streamed to asyncio. Thread-safe.

    `stream(...)` is an async generator of `RequestOutput` increments (the last one has `finished=True`);
    it raises ValueError / ContextLengthError / AdmissionError at its first `__anext__`, before any
    output. Closing it early (client disconnect, task cancelled) aborts the request and frees its cache.
    `abort(request_id)` ends the stream with a final output whose finish_reason is "abort". Neither
    `abort` nor `metrics` waits for a running step.
    """

    def __init__(self, engine: Engine, idle_wait: float = 0.05):
        self.engine = engine
        self.idle_wait = idle_wait
        self._engine_lock = threading.Lock()  # held around every Engine call
        self._lock = threading.Lock()  # guards the small shared state below; never held across a step
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._aborts: list[str] = []
        self._early_aborts: set[str] = set()
        self._metrics = engine.metrics()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()

    async def stream(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams | None = None,
                     media: list[MediaInput] | None = None) -> AsyncIterator[RequestOutput]:
        media = media if media is not None else getattr(prompt_ids, "media", None)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        added = finished = False
        try:
            try:
                await asyncio.to_thread(self._add, request_id, list(prompt_ids), sampling, loop, queue, media)
            except asyncio.CancelledError:
                self.abort(request_id, notify=False)  # the add may still land: `_add` checks for this
                raise
            added = True
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"the engine failed: {item!r}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if added and not finished:
                self.abort(request_id, notify=False)

    def abort(self, request_id: str, notify: bool = True) -> None:
        """Abort a request; its pages are freed before the next step."""
        with self._lock:
            self._aborts.append(request_id)
            entry = self._queues.pop(request_id, None)
        self._wake.set()
        if entry is not None and notify:
            loop, queue = entry
            out = RequestOutput(request_id, [], finished=True, finish_reason="abort")
            loop.call_soon_threadsafe(queue.put_nowait, out)

    def metrics(self) -> dict:
        """The latest snapshot (refreshed every 0.25 s while busy, and whenever the engine goes idle)."""
        with self._lock:
            return self._metrics

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def accepts_media(self) -> bool:
        return self.engine.accepts_media

    @property
    def media_pad_id(self) -> int:
        return self.engine.media_pad_id

    def check_admissible(self, totals: list[int]) -> None:
        """`Engine.check_admissible` (reads the engine's fixed config only, so it takes no lock)."""
        self.engine.check_admissible(totals)

    def idle(self) -> bool:
        """No request queued or running, and no abort pending."""
        with self._engine_lock, self._lock:
            return not self.engine.has_unfinished() and not self._aborts

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _add(self, request_id, prompt_ids, sampling, loop, queue, media=None) -> None:
        # images are hashed here, outside the lock, so a large one does not hold up the engine's steps
        media = [m if m.key else dataclasses.replace(m, key=media_key(m)) for m in media] if media else media
        with self._engine_lock:
            if self._error is not None:
                raise RuntimeError(f"the engine failed earlier: {self._error!r}")
            try:
                self.engine.add_request(request_id, prompt_ids, sampling, media)
            except Exception:
                self._early_aborts.discard(request_id)
                raise
            self._register(request_id, loop, queue)
        self._wake.set()

    def _register(self, request_id, loop, queue) -> None:
        """After the engine took a request (under `_engine_lock`): route its outputs to `queue`, unless the caller
        left meanwhile (then abort it)."""
        if request_id in self._early_aborts:
            self._early_aborts.discard(request_id)
            self.engine.abort(request_id)
            return
        with self._lock:
            self._queues[request_id] = (loop, queue)
            self._metrics = self.engine.metrics()

    def _loop(self) -> None:
        last_snapshot = 0.0
        while not self._stopped:
            with self._engine_lock:
                busy = self.engine.has_unfinished()
            with self._lock:
                busy = busy or bool(self._aborts)
            if not busy:
                self._wake.wait(self.idle_wait)
                self._wake.clear()
                continue
            targets, failed = [], None
            with self._engine_lock:
                with self._lock:
                    aborts, self._aborts = self._aborts, []
                for rid in aborts:
                    if not self.engine.abort(rid):
                        self._early_aborts.add(rid)  # aborted before its add landed (see _add)
                try:
                    outputs = self.engine.step() if self.engine.has_unfinished() else []
                except Exception as e:  # a bug: fail every stream rather than leave them hanging
                    self._error = failed = e
                    for rid in list(self.engine.requests):
                        self.engine.abort(rid)
                    outputs = []
                # a snapshot walks the prefix cache: take one every 0.25 s while busy, and when idle
                now = time.monotonic()
                snapshot = None
                if now - last_snapshot >= 0.25 or not self.engine.has_unfinished():
                    snapshot, last_snapshot = self.engine.metrics(), now
            with self._lock:
                if snapshot is not None:
                    self._metrics = snapshot
                if failed is not None:
                    targets = [(entry, failed) for entry in self._queues.values()]
                    self._queues.clear()
                for out in outputs:
                    entry = self._queues.get(out.request_id)
                    if entry is not None:
                        targets.append((entry, out))
                        if out.finished:
                            del self._queues[out.request_id]
            for (loop, queue), item in targets:
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, item)
                except RuntimeError:  # the consumer's event loop is closed
                    if not isinstance(item, BaseException):
                        self.abort(item.request_id, notify=False)
