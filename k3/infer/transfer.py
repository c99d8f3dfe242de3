"""Prefill/decode disaggregation: one request's hybrid cache moved from a prefill engine to a decode engine
(docs/serving.md, "Across devices"; K3 report §5.4).

Legend: n cached tokens, D = kv_lora_rank + qk_rope_head_dim, H heads, K head dim, W-1 conv tail rows.

A prefill instance runs the prompt and samples the first token; `export_sequence` then copies what the cache holds
for the request — per MLA layer its latent rows [n, D], per KDA layer the recurrent state [H, K, K] (fp32) and the
three conv tails [3, W-1, H·K] — with its tokens, sampling settings and generator state, and the request is dropped
there (its prompt stays in that instance's prefix cache). `add_prefilled` on the decode instance admits it like
`add_request` (same checks and budgets), writes the rows and states into fresh pages and puts it straight into the
running set: its next step decodes the first token, the prompt is never recomputed. If the pool cannot take it at
once it waits like a preempted request and is recomputed when admitted, so nothing is lost.

**TP layout.** The KDA tensors travel with all H heads (`merge_heads` of the prefill ranks' slices); each decode
rank keeps its own chunk (`split_heads`), so the two sides' tensor-parallel degrees need not match. MLA latents
are replicated across ranks and travel once.

**Wire format** (`to_bytes` / `from_bytes`): one safetensors blob. Tensors `mla.{j}` [n, D] (the pool's dtype),
`kda.{j}.state` [H, K, K] fp32 and `kda.{j}.conv` [3, W-1, H·K] for the j-th MLA / KDA layer in layer order, and
`generator` (uint8, the torch generator state); its `__metadata__["k3_transfer"]` is a JSON object with `version`,
`request_id`, `prompt_ids`, `output_ids`, `num_computed`, `sampling` (the `SamplingParams` fields, no grammar) and
`first_output` (the prefill side's `RequestOutput` of the first token, logprobs included). Over TCP
(`PrefillServer` / `request_prefill`) every message is a frame: 8-byte big-endian length, then the payload. The
decode side sends one JSON frame {request_id, prompt_ids, sampling}; the prefill side answers with a JSON frame
{status: "prefilled" | "finished" | "error", ...}, followed for "prefilled" by the blob frame. "finished" carries
the whole output (the first token ended the request); on "error", a broken connection or a malformed blob the
decode side prefills the request itself (`DisaggregatedEngine`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import socket
import socketserver
import struct
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from k3.infer.api import RequestOutput, SamplingParams, TokenLogprob
from k3.infer.engine import AsyncEngine
from k3.infer.prefix_cache import MLABlock
from k3.infer.sequence import SequenceStatus

WIRE_VERSION = 1


class TransferError(RuntimeError):
    """A transfer that could not complete (peer down, connection cut, malformed payload, shapes that do not fit)."""


@dataclass
class PrefilledRequest:
    """One request's state after its prefill, in the canonical layout (all heads) unless split for a rank."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int]  # tokens sampled on the prefill side (the first one)
    num_computed: int  # tokens whose cache rows and states are included (the prompt)
    mla: list[torch.Tensor]  # per MLA layer [n, D]
    kda_state: list[torch.Tensor]  # per KDA layer [H, K, K] fp32
    kda_conv: list[torch.Tensor]  # per KDA layer [3, W-1, H·K]
    generator_state: torch.Tensor  # uint8
    first_output: RequestOutput = field(default_factory=lambda: RequestOutput("", []))

    @property
    def num_heads(self) -> int:
        return self.kda_state[0].shape[0] if self.kda_state else 0


# -- one engine ---------------------------------------------------------------------------------------------------

@torch.no_grad()
def export_sequence(engine, request_id: str) -> PrefilledRequest:
    """Copy a running request's cache out of `engine` (after its prefill: the cache holds every token but the last
    sampled one). The request stays in the engine; the caller aborts it."""
    seq = engine.requests.get(request_id)
    if seq is None or seq.status is not SequenceStatus.RUNNING or seq.remaining != 1:
        raise ValueError(f"request {request_id!r} is not a running request whose prefill is done")
    pool, spec = engine.pool, engine.spec
    n = seq.num_computed
    nb = math.ceil(n / spec.page_tokens)
    mla = []
    for j in range(len(spec.mla_layers)):
        pages = torch.tensor([b.pages[j] for b in seq.blocks[:nb]], device=pool.device)
        mla.append(pool.mla[pages].reshape(-1, spec.latent_dim)[:n].cpu().clone())  # [n, D]
    kda_state = [pool.kda_state[p].cpu().clone() for p in seq.kda_pages]
    kda_conv = [pool.kda_conv[p].cpu().clone() for p in seq.kda_pages]
    sampling = dataclasses.replace(seq.sampling, seed=seq.generator.initial_seed())
    return PrefilledRequest(request_id, list(seq.prompt_ids), sampling, list(seq.output_ids), n, mla, kda_state,
                            kda_conv, seq.generator.get_state().cpu().clone())


@torch.no_grad()
def add_prefilled(engine, req: PrefilledRequest, arrival: float | None = None) -> RequestOutput:
    """Admit a prefilled request into `engine` (its heads must be this engine's: `split_heads` first under tensor
    parallelism). Raises what `add_request` raises; TransferError if its shapes do not fit this model. Returns the
    prefill side's first output (to send to the client: this engine does not emit those tokens again)."""
    spec = engine.spec
    _check_fits(spec, req)
    if req.sampling.grammar is not None:
        raise TransferError("grammar-constrained requests are prefilled where they decode")
    engine.add_request(req.request_id, req.prompt_ids, req.sampling)
    seq = engine.requests[req.request_id]
    seq.generator.set_state(req.generator_state.clone())
    seq.tokens = list(req.prompt_ids) + list(req.output_ids)
    seq.output_ids = list(req.output_ids)
    seq.emitted_tokens = len(req.output_ids)
    seq.admitted_once = True
    now = time.monotonic()
    if arrival is not None:
        seq.arrival = arrival
    seq.first_token_time = seq.last_token_time = now
    engine.metrics_state.observe("time_to_first_token_seconds", now - seq.arrival)
    if _place(engine, seq, req):
        engine.scheduler.waiting.remove(seq)
        engine.scheduler.running.append(seq)
    # else it waits, and is recomputed (prompt + first token) when admitted, like a preempted request
    return req.first_output


def _check_fits(spec, req: PrefilledRequest) -> None:
    want = (len(spec.mla_layers), len(spec.kda_layers))
    got = (len(req.mla), len(req.kda_state))
    if want != got:
        raise TransferError(f"the transfer holds {got[0]} MLA and {got[1]} KDA layers, this model {want}")
    for t in req.mla:
        if t.shape != (req.num_computed, spec.latent_dim):
            raise TransferError(f"an MLA latent of shape {list(t.shape)}, expected [{req.num_computed}, "
                                f"{spec.latent_dim}]")
    for s, c in zip(req.kda_state, req.kda_conv):
        if s.shape != (spec.num_heads, spec.head_dim, spec.head_dim) or \
                c.shape != (3, spec.conv_rows, spec.num_heads * spec.head_dim):
            raise TransferError(f"a KDA state {list(s.shape)} / conv {list(c.shape)} that does not fit this model's "
                                f"{spec.num_heads} heads of {spec.head_dim} (split the heads for this rank first)")
    if req.num_computed != len(req.prompt_ids) + len(req.output_ids) - 1:
        raise TransferError("the transfer's cache must hold every token but the last sampled one")


def _place(engine, seq, req: PrefilledRequest) -> bool:
    """Write the request's rows and states into fresh pages; False (nothing held) if the pool cannot take it now."""
    spec, pool, prefix, sched = engine.spec, engine.pool, engine.prefix, engine.scheduler
    pt, n = spec.page_tokens, req.num_computed
    n_mla, n_kda = len(spec.mla_layers), len(spec.kda_layers)
    nb = math.ceil(n / pt)
    # the same head-room rule as admission: the running requests keep room for their next page
    if prefix.reclaimable() < nb * n_mla + n_kda + n_mla * (len(sched.running) + 1) or \
            len(sched.running) >= engine.config.max_running:
        return False
    blocks = []
    for i in range(nb):
        pages = prefix.allocate(n_mla)
        assert pages is not None  # reclaimable() said so
        blocks.append(MLABlock(tuple(pages), i))
    kda_pages = prefix.allocate(n_kda) if n_kda else []
    dev = pool.device
    for j in range(n_mla):
        rows = req.mla[j].to(dev, spec.dtype)
        for i, block in enumerate(blocks):
            piece = rows[i * pt:(i + 1) * pt]
            pool.mla[block.pages[j], :piece.shape[0]] = piece
    for j, page in enumerate(kda_pages):
        pool.kda_state[page] = req.kda_state[j].to(dev, torch.float32)
        pool.kda_conv[page] = req.kda_conv[j].to(dev, spec.dtype)
    seq.blocks, seq.kda_pages, seq.num_computed = blocks, kda_pages, n
    seq.num_registered = 0  # the first decode step indexes the prompt's hash blocks in this prefix cache
    seq.status = SequenceStatus.RUNNING
    return True


# -- tensor-parallel layouts --------------------------------------------------------------------------------------

def merge_heads(parts: list[PrefilledRequest]) -> PrefilledRequest:
    """The ranks' slices (rank order) -> all heads. MLA latents are replicated: rank 0's are kept."""
    first = parts[0]
    state = [torch.cat([p.kda_state[j] for p in parts]) for j in range(len(first.kda_state))]
    conv = [torch.cat([p.kda_conv[j] for p in parts], dim=-1) for j in range(len(first.kda_conv))]
    return dataclasses.replace(first, kda_state=state, kda_conv=conv)


def split_heads(req: PrefilledRequest, parts: int, index: int) -> PrefilledRequest:
    """Chunk `index` of `parts` of the KDA heads (the layout of tensor-parallel rank `index`)."""
    if parts == 1:
        return req
    H = req.num_heads
    if H % parts:
        raise TransferError(f"{H} KDA heads cannot be split over {parts} ranks")
    h = H // parts
    state = [s[index * h:(index + 1) * h] for s in req.kda_state]
    conv = [c.view(3, c.shape[1], H, -1)[:, :, index * h:(index + 1) * h].reshape(3, c.shape[1], -1)
            for c in req.kda_conv]
    return dataclasses.replace(req, kda_state=state, kda_conv=conv)


# -- the wire format ----------------------------------------------------------------------------------------------

def _sampling_json(sp: SamplingParams) -> dict:
    return {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp) if f.name != "grammar"}


def _output_json(out: RequestOutput) -> dict:
    return dataclasses.asdict(out)


def _output_from_json(d: dict) -> RequestOutput:
    lps = d.get("logprobs")
    if lps is not None:
        lps = [TokenLogprob(lp["token_id"], lp["logprob"], [tuple(t) for t in lp["top"]]) for lp in lps]
    return RequestOutput(**{**d, "logprobs": lps})


def to_bytes(req: PrefilledRequest) -> bytes:
    """The wire format (module doc): one safetensors blob."""
    tensors = {f"mla.{j}": t.contiguous() for j, t in enumerate(req.mla)}
    tensors.update({f"kda.{j}.state": t.contiguous() for j, t in enumerate(req.kda_state)})
    tensors.update({f"kda.{j}.conv": t.contiguous() for j, t in enumerate(req.kda_conv)})
    tensors["generator"] = req.generator_state
    meta = {"version": WIRE_VERSION, "request_id": req.request_id, "prompt_ids": req.prompt_ids,
            "output_ids": req.output_ids, "num_computed": req.num_computed, "sampling": _sampling_json(req.sampling),
            "first_output": _output_json(req.first_output)}
    return st_save(tensors, metadata={"k3_transfer": json.dumps(meta)})


def from_bytes(blob: bytes) -> PrefilledRequest:
    """Parse `to_bytes`'s blob; TransferError if it is not one (truncated, another version, missing tensors)."""
    try:
        (header_len,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8:8 + header_len])
        meta = json.loads(header["__metadata__"]["k3_transfer"])
        tensors = st_load(blob)
    except Exception as e:
        raise TransferError(f"not a k3 transfer blob ({type(e).__name__}: {e})") from None
    if meta.get("version") != WIRE_VERSION:
        raise TransferError(f"transfer version {meta.get('version')}, this build reads {WIRE_VERSION}")
    try:
        n_mla = sum(1 for k in tensors if k.startswith("mla."))
        n_kda = sum(1 for k in tensors if k.endswith(".state"))
        sampling = SamplingParams(**{**meta["sampling"], "stop_token_ids": tuple(meta["sampling"]["stop_token_ids"])})
        return PrefilledRequest(meta["request_id"], meta["prompt_ids"], sampling, meta["output_ids"],
                                meta["num_computed"], [tensors[f"mla.{j}"] for j in range(n_mla)],
                                [tensors[f"kda.{j}.state"] for j in range(n_kda)],
                                [tensors[f"kda.{j}.conv"] for j in range(n_kda)], tensors["generator"],
                                _output_from_json(meta["first_output"]))
    except (KeyError, TypeError) as e:
        raise TransferError(f"a transfer blob without {e}") from None


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack(">Q", len(payload)) + payload)


def recv_frame(sock: socket.socket, limit: int = 1 << 40) -> bytes:
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise TransferError(f"the connection closed after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    (n,) = struct.unpack(">Q", exactly(8))
    if n > limit:
        raise TransferError(f"a frame of {n} bytes is over the limit")
    return exactly(n)


# -- the prefill instance -----------------------------------------------------------------------------------------

class PrefillWorker:
    """Drives a prefill engine (an `Engine` or a `k3.parallel.inference.ParallelEngine`) in a thread: requests come
    in, are batched, and each leaves after its first token with its exported state (`submit` -> Future of
    ("prefilled", PrefilledRequest) or ("finished", RequestOutput))."""

    def __init__(self, engine, idle_wait: float = 0.02):
        self.engine, self.idle_wait = engine, idle_wait
        self._inbox: queue.Queue = queue.Queue()
        self._pending: dict[str, Future] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="k3-prefill", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> Future:
        fut: Future = Future()
        self._inbox.put((request_id, prompt_ids, sampling, fut))
        return fut

    def shutdown(self) -> None:
        self._stopped = True
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopped:
            try:
                item = self._inbox.get(timeout=self.idle_wait) if not engine.has_unfinished() else \
                    self._inbox.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                rid, ids, sp, fut = item
                try:
                    engine.add_request(rid, ids, sp)
                    self._pending[rid] = fut
                except Exception as e:
                    fut.set_exception(e)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
                for out in outputs:
                    fut = self._pending.pop(out.request_id)
                    if out.finished:
                        fut.set_result(("finished", out))
                        continue
                    req = engine.export_sequence(out.request_id)
                    engine.abort(out.request_id)
                    fut.set_result(("prefilled", dataclasses.replace(req, first_output=out)))
            except Exception as e:  # fail every waiting request rather than leave it hanging
                for rid, fut in list(self._pending.items()):
                    engine.abort(rid)
                    fut.set_exception(e)
                self._pending.clear()


class PrefillServer:
    """A TCP front for a `PrefillWorker` (the wire format in the module doc). `address` is (host, port)."""

    def __init__(self, worker: PrefillWorker, host: str = "127.0.0.1", port: int = 0):
        self.worker = worker

        class Handler(socketserver.BaseRequestHandler):
            def handle(inner):
                sock = inner.request
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    msg = json.loads(recv_frame(sock, limit=1 << 30))
                    sp = SamplingParams(**{**msg["sampling"], "stop_token_ids": tuple(msg["sampling"]["stop_token_ids"])})
                    kind, value = worker.submit(msg["request_id"], msg["prompt_ids"], sp).result()
                except Exception as e:
                    send_frame(sock, json.dumps({"status": "error", "message": f"{type(e).__name__}: {e}"}).encode())
                    return
                if kind == "finished":
                    send_frame(sock, json.dumps({"status": "finished", "output": _output_json(value)}).encode())
                else:
                    send_frame(sock, json.dumps({"status": "prefilled"}).encode())
                    send_frame(sock, to_bytes(value))

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server((host, port), Handler)
        self.address = self.server.server_address
        self._thread = threading.Thread(target=self.server.serve_forever, name="k3-prefill-server", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def parse_peer(peer: str) -> tuple[str, int]:
    host, _, port = peer.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--peer must be HOST:PORT, got {peer!r}")
    return host, int(port)


def request_prefill(peer: tuple[str, int], request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                    timeout: float = 120.0) -> PrefilledRequest | RequestOutput:
    """Ask a prefill instance to prefill one request: its exported state, or its final output if the first token
    ended it. TransferError on any failure (the caller prefills locally)."""
    if sampling.grammar is not None:
        raise TransferError("grammar-constrained requests are prefilled where they decode")
    try:
        with socket.create_connection(peer, timeout=timeout) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_frame(sock, json.dumps({"request_id": request_id, "prompt_ids": list(prompt_ids),
                                         "sampling": _sampling_json(sampling)}).encode())
            reply = json.loads(recv_frame(sock, limit=1 << 30))
            if reply.get("status") == "finished":
                return _output_from_json(reply["output"])
            if reply.get("status") != "prefilled":
                raise TransferError(f"the prefill instance answered: {reply.get('message', reply)}")
            req = from_bytes(recv_frame(sock))
    except (OSError, ValueError, KeyError, TypeError) as e:  # TransferError is a RuntimeError: it passes through
        raise TransferError(f"prefill at {peer[0]}:{peer[1]} failed: {type(e).__name__}: {e}") from None
    if req.request_id != request_id or req.prompt_ids != list(prompt_ids):
        raise TransferError("the prefill instance returned another request's state")
    return req


class DisaggregatedEngine(AsyncEngine):
    """The decode instance's `AsyncEngine`: each request (text only, at least `min_prompt_tokens` long) is prefilled
    by the instance at `peer`, then imported and decoded here; any transfer failure prefills it here instead
    (counted in `transfer_fallbacks`)."""

    def __init__(self, engine, peer: tuple[str, int], min_prompt_tokens: int = 1, timeout: float = 120.0, **kw):
        self.peer, self.min_prompt_tokens, self.timeout = peer, min_prompt_tokens, timeout
        self.transfers = self.transfer_fallbacks = 0
        super().__init__(engine, **kw)

    def metrics(self) -> dict:
        return {**super().metrics(), "transfers_total": self.transfers, "transfer_fallbacks_total": self.transfer_fallbacks}

    def _add(self, request_id, prompt_ids, sampling, loop, queue, media=None) -> None:
        sampling = sampling or SamplingParams()
        if media or len(prompt_ids) < self.min_prompt_tokens or sampling.grammar is not None:
            return super()._add(request_id, prompt_ids, sampling, loop, queue, media)
        arrival = time.monotonic()
        with self._engine_lock:  # the request's own checks first: a request refused here never leaves
            self.engine.check_admissible([len(prompt_ids) + sampling.max_tokens])
        try:
            got = request_prefill(self.peer, request_id, prompt_ids, sampling, self.timeout)
        except TransferError:
            self.transfer_fallbacks += 1
            return super()._add(request_id, prompt_ids, sampling, loop, queue, media)
        if isinstance(got, RequestOutput):  # the first token ended it
            loop.call_soon_threadsafe(queue.put_nowait, got)
            return
        with self._engine_lock:
            if self._error is not None:
                raise RuntimeError(f"the engine failed earlier: {self._error!r}")
            try:
                first = self.engine.add_prefilled(got, arrival)
            except TransferError:
                self.transfer_fallbacks += 1
                first = None
            if first is None:
                self.engine.add_request(request_id, prompt_ids, sampling)
            else:
                self.transfers += 1
                loop.call_soon_threadsafe(queue.put_nowait, first)
            self._register(request_id, loop, queue)
        self._wake.set()
