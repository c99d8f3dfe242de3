"""Tensor- and expert-parallel serving: the single-device model sharded over a process group afterwards, and the
inference engine run SPMD on every rank (docs/serving.md, "Across devices"; K3 report §5.4).

Legend: T ranks of the group, H heads, K head dim, P = H·K, I FFN / expert hidden width, E experts, V vocabulary.

**Layout.** Rank r builds the model of a *local* config (`local_config`: H/T KDA and MLA heads, I/T dense, shared
and routed-expert hidden width) and holds chunk r of every sharded tensor:
- column-parallel (chunk of dim 0, by head or hidden unit): KDA q/k/v/g/b/f_b projections, the three convs,
  dt_bias, A_log; MLA q_b_proj, kv_b_proj, g_proj; gate/up of the dense FFN and the shared experts; the head
  (vocab-parallel, when T divides V);
- row-parallel (chunk of dim 1), followed by an all-reduce: every `o_proj`, the FFNs' `down_proj`;
- routed experts: chunk of the hidden width I (w1/w3 dim 1, w2 dim 2), or with `expert_parallel` whole experts
  E/T per rank (`ExpertShard`); either way each rank computes its part for every token and the latent sum is
  all-reduced before the routed-expert norm;
- replicated: embedding, norms, AttnRes queries, router, the MLA down-projections and latent norm (the latent is
  shared by heads), the KDA decay's first factor f_a and the per-head output norm's gain.
Which chunk a tensor gets is found by shape: the one dimension where the local tensor is smaller than the full one.
The collectives are forward hooks on those modules (`add_collectives`): the model code stays single-device.

**The engine.** Every rank runs an identical `Engine` over its local model; `CacheSpec` of the local config
holds H/T heads of each KDA state, so the paged KDA cache is sharded by head without any engine change, while each
rank keeps the full MLA latent pages (replicated: the latent has no head axis). Rank 0 owns the inputs
(`ParallelEngine`): it validates and admits a request on its own engine, then sends the event (with the seed it
drew) to the other ranks in the next step's broadcast; every rank then applies the same events in the same order
and calls `Engine.step()`. The schedule depends only on that event sequence (admission budgets, page counts,
the prefix cache and preemption are deterministic; wall-clock only feeds metrics and `retry_after`, which only rank
0's rejected requests see), and the logits are bitwise equal on all ranks (all-reduce and all-gather results
are the same on every rank), so every rank samples the same tokens. Each broadcast carries a digest of rank 0's
previous outputs, checked by the others: a divergence stops the group with an error instead of corrupting it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from k3.config import ModelConfig
from k3.infer.transfer import merge_heads, split_heads
from k3.model.model import K3ForCausalLM
from k3.model.moe import LatentExperts, swiglu

# modules whose output is a partial sum over the ranks (row-parallel, or this rank's share of the experts)
REDUCED_SUFFIXES = ("self_attn.o_proj", "mlp.down_proj", "shared_experts.down_proj", "block_sparse_moe.experts")


@dataclass(frozen=True)
class TPGroup:
    """The ranks serving one model: `group` (None: the whole world), this process's index in it, and the global
    ranks in group order (`ranks[0]` owns the scheduler inputs)."""

    group: object
    rank: int
    size: int
    ranks: tuple[int, ...]

    @classmethod
    def world(cls) -> TPGroup:
        return cls(None, dist.get_rank(), dist.get_world_size(), tuple(range(dist.get_world_size())))

    @classmethod
    def of(cls, ranks: list[int]) -> TPGroup:
        """A sub-group: every process of the world must call this with the same `ranks` (gloo/NCCL rule)."""
        group = dist.new_group(list(ranks))
        me = dist.get_rank()
        return cls(group, ranks.index(me) if me in ranks else -1, len(ranks), tuple(ranks))

    @property
    def src(self) -> int:
        return self.ranks[0]


def init_serving_group(backend: str | None = None) -> TPGroup:
    """Join the torchrun group (env://) for serving. The timeout is long: followers wait in a broadcast while the
    server is idle, for as long as no request comes."""
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=datetime.timedelta(days=365))
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())) % torch.cuda.device_count())
    return TPGroup.world()


# -- the local model -----------------------------------------------------------------------------------------------

def local_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config of one rank's shard: H/T heads (KDA and MLA), I/T dense, shared and routed-expert width."""
    H = config.num_attention_heads
    need = {"heads (num_attention_heads)": H, "intermediate_size": config.intermediate_size,
            "moe_intermediate_size": config.moe_intermediate_size}
    bad = [f"{name} {n}" for name, n in need.items() if n % tp]
    if bad:
        raise ValueError(f"--tensor-parallel {tp} must divide the model's {', '.join(bad)}")
    lin = dataclasses.replace(config.linear_attn_config, num_heads=H // tp)
    return config.replace(num_attention_heads=H // tp, num_key_value_heads=H // tp, linear_attn_config=lin,
                          intermediate_size=config.intermediate_size // tp,
                          moe_intermediate_size=config.moe_intermediate_size // tp)


class ExpertShard(LatentExperts):
    """Experts `first_expert … first_expert + E/T - 1` of a layer (expert parallelism): takes the global routes,
    runs the pairs routed to its experts, and returns their weighted sum for every token [N, L] (fp32; zero rows
    for tokens with none here). The group's all-reduce adds the other ranks' experts. Same parameter names."""

    def __init__(self, experts: LatentExperts, num_local: int, first_expert: int, intermediate_size: int):
        super().__init__(num_local, experts.w1.shape[2], intermediate_size, experts.beta1, experts.beta2, experts.impl,
                         "silu" if experts.glu is swiglu else "situ", experts.qat_scale_mode)
        self.first_expert = first_expert

    def forward(self, z: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        local = topk_idx - self.first_expert
        mine = (local >= 0) & (local < self.w1.shape[0])
        if z.is_cuda and torch.cuda.is_current_stream_capturing():
            # a captured decode step has static shapes: every pair runs here, the other ranks' pairs with weight 0
            return super().forward(z, local.clamp(0, self.w1.shape[0] - 1), torch.where(mine, weights, 0.0))
        rows, cols = mine.nonzero(as_tuple=True)  # the (token, slot) pairs routed here
        accum = torch.float64 if z.dtype == torch.float64 else torch.float32
        out = torch.zeros(z.shape[0], z.shape[1], dtype=accum, device=z.device)
        if rows.numel():
            part = super().forward(z[rows], local[rows, cols][:, None], weights[rows, cols][:, None])  # [M, L]
            out.index_add_(0, rows, part.to(accum))
        return out


def build_local_model(config: ModelConfig, tp: TPGroup, expert_parallel: bool = False) -> K3ForCausalLM:
    """This rank's model skeleton on the meta device (shapes of its shard; no collectives attached yet)."""
    cfg = local_config(config, tp.size)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
        if expert_parallel:
            E = config.num_experts
            if E % tp.size:
                raise ValueError(f"--expert-parallel needs the {tp.size} ranks to divide the {E} experts")
            per = E // tp.size
            for layer in model.model.layers:
                if layer.is_moe:
                    moe = layer.block_sparse_moe
                    moe.experts = ExpertShard(moe.experts, per, tp.rank * per, config.moe_intermediate_size)
        if config.vocab_size % tp.size == 0 and tp.size > 1:
            model.lm_head = nn.Linear(config.hidden_size, config.vocab_size // tp.size, bias=False)
    model.vocab_parallel_head = config.vocab_size % tp.size == 0 and tp.size > 1
    return model


def shard_index(local_shape: tuple[int, ...], full_shape: tuple[int, ...], rank: int, name: str) -> tuple[slice, ...]:
    """The slices of the full tensor that rank `rank` holds: chunk `rank` along the one dimension where the local
    shape is smaller (a released A_log is padded past H: its chunk is still rank·H/T …)."""
    if len(local_shape) != len(full_shape):
        raise ValueError(f"{name}: the checkpoint holds shape {list(full_shape)}, this model {list(local_shape)}")
    index = []
    for d, (n, full) in enumerate(zip(local_shape, full_shape)):
        if n == full:
            index.append(slice(None))
        elif n < full:
            index.append(slice(rank * n, (rank + 1) * n))
        else:
            raise ValueError(f"{name}: the checkpoint holds shape {list(full_shape)}, smaller than this rank's "
                             f"{list(local_shape)}")
    if sum(s != slice(None) for s in index) > 1:
        raise ValueError(f"{name}: sharded along more than one dimension ({list(full_shape)} -> {list(local_shape)})")
    return tuple(index)


def add_collectives(model: K3ForCausalLM, tp: TPGroup) -> K3ForCausalLM:
    """Forward hooks: all-reduce the row-parallel outputs and the experts' partial sums; all-gather a vocab-parallel
    head's logits. With one rank nothing is added."""
    if tp.size == 1:
        return model
    group = tp.group

    def all_reduce(module, args, out):
        dist.all_reduce(out, group=group)
        return out

    def all_gather(module, args, out):
        parts = [torch.empty_like(out) for _ in range(tp.size)]
        dist.all_gather(parts, out.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    for name, module in model.named_modules():
        if name.endswith(REDUCED_SUFFIXES):
            module.register_forward_hook(all_reduce)
    if getattr(model, "vocab_parallel_head", False):
        model.lm_head.register_forward_hook(all_gather)
    return model


@torch.no_grad()
def shard_model(full: K3ForCausalLM, tp: TPGroup, expert_parallel: bool = False) -> K3ForCausalLM:
    """This rank's shard of a full model held in memory (random `--preset` weights, tests), collectives attached."""
    model = build_local_model(full.config, tp, expert_parallel)
    device = next(full.parameters()).device
    model.to_empty(device=device)
    state = full.state_dict()
    for name, target in model.state_dict(keep_vars=True).items():
        source = state[name]
        target.data = source[shard_index(tuple(target.shape), tuple(source.shape), tp.rank, name)].clone()
    return add_collectives(model.eval(), tp)


@torch.no_grad()
def load_sharded(path: str | Path, tp: TPGroup, expert_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", runtime: dict | None = None) -> K3ForCausalLM:
    """This rank's shard read straight from disk, slice by slice (`safe_open(...).get_slice`): a k3 checkpoint (a run
    folder's newest or a checkpoint folder, manifest verified) or a release-layout directory (an index and its
    shards; MXFP4 experts dequantised one expert at a time). No rank holds more than its shard plus one tensor."""
    from safetensors import safe_open

    from k3.checkpoint import resolve_checkpoint, verify_checkpoint
    from k3.convert import names as N
    from k3.convert.release import INDEX_FILE, read_weight_map
    from k3.ops.mx import mx_dequantize

    path = Path(path)
    # a k3 checkpoint has a manifest (a run folder, checkpoints/); a release directory neither
    release = (path / INDEX_FILE).is_file() or not ((path / "manifest.json").exists() or (path / "checkpoints").is_dir())
    if not release:
        path = resolve_checkpoint(path)
        verify_checkpoint(path)
    config = ModelConfig.load(path / "config.json").replace(**(runtime or {}))
    packed = release and N.experts_are_packed(config)
    config = config.replace(quantization_config=None)
    dtype = dtype or (getattr(torch, config.dtype) if release else torch.float32)
    model = build_local_model(config, tp, expert_parallel)
    model.cast(dtype)
    model.to_empty(device=device)
    weight_map = read_weight_map(path)
    handles: dict[str, object] = {}

    def open_slice(name: str):
        shard = weight_map.get(name)
        if shard is None:
            raise ValueError(f"{path}: tensor {name!r} is missing")
        if shard not in handles:
            handles[shard] = safe_open(str(path / shard), "pt", device="cpu")
        return handles[shard].get_slice(name)

    for name, target in model.state_dict(keep_vars=True).items():
        if not N.is_expert_name(name):
            sl = open_slice(N.TEXT_PREFIX + name if release else name)
            target.copy_(sl[shard_index(tuple(target.shape), tuple(sl.get_shape()), tp.rank, name)])
            continue
        if not release:  # stacked [E, ·, ·]: the expert range and the hidden-width chunk in one read
            sl = open_slice(name)
            index = shard_index(tuple(target.shape), tuple(sl.get_shape()), tp.rank, name)
            target.copy_(sl[index])
            continue
        module, kind = name.rsplit(".", 1)
        first = getattr(_module(model, module), "first_expert", 0)
        for e in range(target.shape[0]):
            stem = f"{N.TEXT_PREFIX}{module}.{first + e}.{kind}"
            if packed:  # one expert dequantised whole, then cut (MX blocks run along the dim we may cut)
                w = mx_dequantize(open_slice(f"{stem}.weight_packed")[:], open_slice(f"{stem}.weight_scale")[:],
                                  "e2m1", N.MXFP4_GROUP, dtype=target.dtype)
                target[e].copy_(w[shard_index(tuple(target.shape[1:]), tuple(w.shape), tp.rank, name)])
            else:
                sl = open_slice(f"{stem}.weight")
                target[e].copy_(sl[shard_index(tuple(target.shape[1:]), tuple(sl.get_shape()), tp.rank, name)])
    handles.clear()
    return add_collectives(model.eval(), tp)


def _module(model: nn.Module, name: str) -> nn.Module:
    for part in name.split("."):
        model = getattr(model, part)
    return model


# -- the engine, SPMD --------------------------------------------------------------------------------------------

def _digest(outputs) -> int:
    return zlib.crc32(repr([(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs]).encode())


class ParallelEngine:
    """Rank 0's face of a group of identical engines (see the module doc): what `AsyncEngine` and the server use.

    `add_request` and `abort` run on rank 0's engine at once (so errors and admission answer immediately) and are
    queued; `step` sends the queue to the other ranks, which replay it, and all ranks step together. Everything
    else (metrics, limits) is rank 0's engine's. Requests with images are refused (the tower is not sharded)."""

    accepts_media = False

    def __init__(self, engine, tp: TPGroup):
        self.engine, self.tp = engine, tp
        self._events: list[tuple] = []
        self._last_digest = _digest([])

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add_request(self, request_id: str, prompt_ids, sampling=None, media=None) -> None:
        if media or getattr(prompt_ids, "media", None):
            raise ValueError("media: images are not served with tensor parallelism (the vision tower is not sharded)")
        if sampling is not None and sampling.grammar is not None:
            try:
                pickle.dumps(sampling.grammar)
            except Exception as e:
                raise ValueError(f"grammar: this grammar cannot be sent to the other ranks ({e})") from None
        self.engine.add_request(request_id, list(prompt_ids), sampling)
        seq = self.engine.requests[request_id]
        # the seed rank 0 drew goes along, so no rank draws its own
        sp = dataclasses.replace(seq.sampling, seed=seq.generator.initial_seed())
        self._events.append(("add_request", (request_id, list(prompt_ids), sp)))

    def abort(self, request_id: str) -> bool:
        done = self.engine.abort(request_id)
        if done:
            self._events.append(("abort", (request_id,)))
        return done

    def collective(self, name: str, *args):
        """Send the queued events plus `(name, args)` to the group and run it on every rank (this one included);
        returns rank 0's result."""
        events, self._events = self._events + [(name, args)], []
        payload = [(self._last_digest, events)]
        dist.broadcast_object_list(payload, src=self.tp.src, group=self.tp.group)
        return apply_events(self, events)[-1]

    def export_sequence(self, request_id: str):
        """The request's cache with every rank's KDA heads (a collective: each rank exports its slice)."""
        return self.collective("export_sequence", request_id)

    def add_prefilled(self, state, arrival: float | None = None):
        """Admit a prefilled request (all heads, `k3.infer.transfer`): each rank keeps its chunk of the heads."""
        first = self.engine.add_prefilled(split_heads(state, self.tp.size, 0), arrival)
        self._events.append(("add_prefilled", (state,)))
        return first

    def step(self):
        outputs = self.collective("step")
        self._last_digest = _digest(outputs)
        return outputs

    def shutdown(self) -> None:
        """Release the other ranks from `follow` (call once, when serving ends)."""
        self.collective("stop")


def apply_events(target, events: list[tuple]) -> list:
    """Run each event on a rank. Rank 0 ran its `add_request`, `abort` and `add_prefilled` already and skips them;
    the others replay them (an imported request keeps this rank's chunk of the KDA heads)."""
    results = []
    tp, engine = target.tp, target.engine
    leader = tp.rank == 0
    for name, args in events:
        if name in ("add_request", "abort"):
            results.append(None if leader else getattr(engine, name)(*args))
        elif name == "add_prefilled":
            results.append(None if leader else engine.add_prefilled(split_heads(args[0], tp.size, tp.rank)))
        elif name == "step":
            results.append(engine.step())
        elif name == "export_sequence":
            local = engine.export_sequence(*args)
            parts = [None] * tp.size if leader else None
            dist.gather_object(local, parts, dst=tp.src, group=tp.group)
            results.append(merge_heads(parts) if leader else None)
        elif name == "stop":
            results.append(None)
        else:
            raise ValueError(f"unknown engine event {name!r}")
    return results


class Follower:
    """A rank other than 0: receives each broadcast and applies it (`follow`)."""

    def __init__(self, engine, tp: TPGroup):
        self.engine, self.tp = engine, tp

    def follow(self) -> None:
        """Apply rank 0's events until it stops; raise if this rank's outputs ever differ from rank 0's."""
        mine = _digest([])
        while True:
            payload = [None]
            dist.broadcast_object_list(payload, src=self.tp.src, group=self.tp.group)
            theirs, events = payload[0]
            if theirs != mine:
                raise RuntimeError(f"rank {self.tp.rank} produced other tokens than rank 0 in the last step: the "
                                   "engines diverged (nondeterministic logits across ranks)")
            results = apply_events(self, events)
            for (name, _), result in zip(events, results):
                if name == "step":
                    mine = _digest(result)
                if name == "stop":
                    return


def serving_engine(engine, tp: TPGroup):
    """Rank 0: the `ParallelEngine` to serve; another rank: its `Follower` (call `.follow()`)."""
    return ParallelEngine(engine, tp) if tp.rank == 0 else Follower(engine, tp)
