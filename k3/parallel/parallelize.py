"""Apply parallelism to a built single-device model, and the few reductions a training step needs.

Order (docs/distributed.md, fixed): expert parallelism (swap routed experts for the EP version) → context
parallelism (switch KDA/MLA mixers to their CP classes) → activation checkpointing per decoder layer
(optional) → FSDP2 `fully_shard` per decoder layer, then the root. FSDP2 shards every parameter over the
flattened dp × cp ranks with `Shard(0)`, except the routed experts, which EP already shards by expert over
the same ranks (FSDP ignores them). Mixed precision on GPU is bf16 autocast over fp32 parameters, exactly as
on one GPU: FSDP2's `param_dtype=bf16` would also round the parameters the model keeps in fp32 (router, KDA
gate `A_log`/`dt_bias`, convs, norms), and `A_log`/`dt_bias` sit on the KDA module itself, so no per-module
policy can exempt them. `param_dtype` can still be set (half the all-gather bytes, with that rounding).

Each rank's loss is its token sum over the *global* token count, so the single-process gradient is the
*sum* of the ranks' gradients. FSDP2 averages (gloo has no pre-multiplied sum for a divide factor of 1),
so the loss is scaled by W (`loss_scale`) and the expert gradients, which EP's all-to-all backward
already summed and FSDP does not touch, are divided back by W (`finish_gradients`).

`ParallelTraining` holds what the loop needs per step: cutting the global batch, the all-reduces of
Quantile Balancing histograms, expert loads, MLA max logits and the loss; the global gradient norm; the
optimizer (P2P Muon); and distributed checkpoints (DCP) that a run with another number of ranks can load.
A single process has the same interface with every collective the identity (`k3.train.runtime.SingleProcess`).
"""

from __future__ import annotations

from pathlib import Path

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from k3.parallel.context_parallel import CPContext, apply_context_parallel
from k3.parallel.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from k3.model.checkpointing import apply_activation_checkpointing
from k3.optim.muon import local_tensor
from k3.parallel.muon import DistributedMuonAdamW

if TYPE_CHECKING:  # annotations only: runtime.py builds on this module
    from k3.parallel.runtime import ParallelRuntime

DCP_MARKER = ".metadata"  # written by dcp.save: a checkpoint directory with it is a distributed one


def parallelize(model: nn.Module, runtime: ParallelRuntime, moonep: bool = True,
                activation_checkpointing: bool = False, param_dtype: torch.dtype | None = None) -> ParallelTraining:
    """EP → CP → activation checkpointing → FSDP2 on `model` (in place); returns the per-step helper.

    param_dtype: FSDP2's parameter dtype in forward/backward; None (default) keeps the parameters' own.
    """
    experts: list[ExpertParallelExperts] = []
    if runtime.dims.ep > 1:
        experts = apply_expert_parallel(model, runtime.fsdp_mesh, use_planner=moonep)
    cp_context = None
    if runtime.dims.cp > 1:
        cp_context = CPContext(runtime.cp_group, runtime.dims.cp, runtime.cp_rank)
        apply_context_parallel(model, cp_context)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    # cast_forward_inputs=False: autocast does the activation casts, and FSDP's input cast would rebuild the
    # containers a layer receives (the model collects router statistics by appending to a list argument)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                              cast_forward_inputs=False)
    ignored = {p for e in experts for p in e.parameters()}
    for layer in model.model.layers:
        layer_ignored = {p for p in layer.parameters() if p in ignored}
        fully_shard(layer, mesh=runtime.fsdp_mesh, mp_policy=mp, ignored_params=layer_ignored or None)
    fully_shard(model, mesh=runtime.fsdp_mesh, mp_policy=mp, ignored_params=ignored or None)
    return ParallelTraining(runtime, model, experts, cp_context)


class ParallelTraining:
    distributed = True  # checkpoints are DCP shards, loadable by any number of ranks
    # the FSDP2 and EP wrappers own their parameters' gradients: no in-place accumulation (k3.ops.weight_grads)
    in_place_weight_grads = False

    def __init__(self, runtime: ParallelRuntime, model: nn.Module, experts: list[ExpertParallelExperts],
                 cp_context: CPContext | None):
        self.runtime, self.model, self.experts, self.cp_context = runtime, model, experts, cp_context

    @property
    def dims(self):
        return self.runtime.dims

    @property
    def loss_scale(self) -> float:
        return float(self.runtime.world_size)

    def build_optimizer(self, config, **kwargs) -> DistributedMuonAdamW:
        """P2P Muon + AdamW over the sharded parameters; `kwargs` as for `k3.optim.MuonAdamW`."""
        return DistributedMuonAdamW(self.model.named_parameters(), config, **kwargs)

    def finish_gradients(self) -> None:
        """After the step's backward passes: undo `loss_scale` on the gradients FSDP did not average."""
        grads = [local_tensor(p.grad) for e in self.experts for p in e.parameters() if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, self.loss_scale)

    def shard(self, input_ids: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor):
        """This rank's piece of a global batch (cut on the host, then moved to the device); also tells the
        CP layers where it sits. Returns (input_ids, labels, cu_seqlens) on the runtime's device."""
        ids, lab, cu, shard = self.runtime.shard_batch(input_ids.cpu(), labels.cpu(), cu_seqlens.cpu())
        device = self.runtime.device
        if self.cp_context is not None:
            on_device = dataclasses.replace(shard, global_segment_ids=shard.global_segment_ids.to(device))
            self.cp_context.set_batch(on_device, cu, device)
        return tuple(t.to(device, non_blocking=True) for t in (ids, lab, cu))

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.runtime.all_reduce_(tensor, dist.ReduceOp.SUM)

    def max_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.runtime.all_reduce_(tensor, dist.ReduceOp.MAX)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of all gradients (local shards are disjoint across ranks), then scale to max_norm.
        Returns the norm (float64, 0-dim, on the device)."""
        grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
        norms = torch._foreach_norm(grads) if grads else []
        sq = torch.stack([n.double() for n in norms]).pow(2).sum() if norms else torch.zeros(
            (), dtype=torch.float64, device=self.runtime.device)
        norm = self.sum_(sq.to(self.runtime.device)).sqrt()
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
        return norm

    def ep_stats(self) -> dict[str, list[float]]:
        if not self.experts:
            return {}
        return {"ep_load_max_over_mean": [e.last_stats["load_max_over_mean"] for e in self.experts],
                "ep_home_load_max_over_mean": [e.last_stats["home_load_max_over_mean"] for e in self.experts]}

    def _state(self, optimizer) -> dict:
        options = StateDictOptions(full_state_dict=False)
        return {"model": get_model_state_dict(self.model, options=options),
                "optim": get_optimizer_state_dict(self.model, optimizer, options=options)}

    def save(self, directory: Path, optimizer) -> dict:
        """Every rank writes its shards of the model and optimizer into `directory` (DCP format). Returns what
        train_state.pt must add (nothing: the optimizer is in the shards)."""
        dcp.save(self._state(optimizer), checkpoint_id=str(directory))
        return {}

    def load(self, directory: Path, optimizer, train_state: dict | None = None) -> None:
        """Load a DCP checkpoint written with any number of ranks into the sharded model and optimizer
        (`train_state` is not needed: the shards hold both)."""
        options = StateDictOptions(full_state_dict=False)
        state = self._state(optimizer)
        # Parameters that never had a gradient (e.g. layer 0's attention-residual query) have no optimizer
        # state in the checkpoint; the fresh placeholders DCP's state-dict helpers create stay for them.
        dcp.load(state, checkpoint_id=str(directory), planner=DefaultLoadPlanner(allow_partial_load=True))
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, optimizer, state["optim"], options=options)
