"""Where a training run executes: one process, or the ranks of a distributed run, behind one interface.

`start_runtime` is the one place that chooses. Under torchrun it returns k3.parallel's `ParallelRuntime`,
whose `parallelize(model)` applies EP → CP → activation checkpointing → FSDP2 and returns a
`ParallelTraining`. Otherwise it returns a `SingleProcess`, which stands for both halves on one device:
every collective is the identity, and a checkpoint is model.safetensors with the optimizer state in
train_state.pt (the distributed run writes DCP shards instead). The loop (`loop.py`) uses only:

    process (before the model exists): device, world_size, is_main, barrier(), check_batch_layout(rows, seq_len),
                                       parallelize(model, moonep, activation_checkpointing)
    model (what parallelize returns):  dims, distributed, loss_scale, in_place_weight_grads, build_optimizer(...),
                                       shard(ids, labels, cu_seqlens), finish_gradients(), sum_(t), max_(t),
                                       clip_grad_norm_(max_norm), ep_stats(), save(dir, optimizer),
                                       load(dir, optimizer, train_state)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from k3.checkpoint import read_model, write_model
from k3.model.checkpointing import apply_activation_checkpointing
from k3.optim import MuonAdamW
from k3.parallel.runtime import ParallelDims, ParallelRuntime


def resolve_device(name: str) -> torch.device:
    """"auto" (CUDA if present, else CPU), or a device this machine has. Raises ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"unknown device {name!r} (auto, cpu, cuda or cuda:N)") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def start_runtime(device: str = "auto", context_parallel: int = 1,
                  expert_parallel: bool = False) -> SingleProcess | ParallelRuntime:
    """The process group when launched by torchrun (RANK and WORLD_SIZE set, 1 process included), else one process
    on `device`."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if context_parallel > 1 or expert_parallel:
            raise ValueError("context_parallel / expert_parallel need several processes: launch with torchrun")
        return SingleProcess(resolve_device(device))
    return ParallelRuntime.from_env(cp=context_parallel, expert_parallel=expert_parallel,
                                    device=None if device == "auto" else device)


class SingleProcess:
    """One process on one device: the interface of `ParallelRuntime` and `ParallelTraining` (k3.parallel) with
    every collective the identity. `parallelize(model)` returns one bound to the model."""

    rank, world_size, is_main = 0, 1, True
    dims = ParallelDims()
    distributed = False  # checkpoints are model.safetensors, with the optimizer in train_state.pt
    loss_scale = 1.0
    # weight gradients are added into .grad where they are computed (k3.ops.weight_grads)
    in_place_weight_grads = True

    def __init__(self, device: torch.device, model: nn.Module | None = None):
        self.device, self.model = device, model

    # the process

    def barrier(self) -> None:
        pass

    def check_batch_layout(self, rows: int, seq_len: int) -> None:
        pass

    def parallelize(self, model: nn.Module, moonep: bool = True,
                    activation_checkpointing: bool = False) -> SingleProcess:
        """Activation checkpointing (optional) on `model`, in place; returns this process bound to it."""
        if activation_checkpointing:
            apply_activation_checkpointing(model)
        return SingleProcess(self.device, model)

    # the model

    def build_optimizer(self, config, **kwargs) -> MuonAdamW:
        return MuonAdamW(self.model.named_parameters(), config, **kwargs)

    def shard(self, input_ids: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor):
        """The whole batch. Host tensors stay there: the model checks them on the host and copies them without
        waiting for the GPU."""
        return input_ids, labels, cu_seqlens

    def finish_gradients(self) -> None:
        pass

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def max_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def ep_stats(self) -> dict[str, list[float]]:
        return {}

    def save(self, directory: Path, optimizer) -> dict[str, Any]:
        """Write model.safetensors into `directory`; returns what train_state.pt must add (the optimizer state)."""
        write_model(directory, self.model.state_dict())
        return {"optimizer": optimizer.state_dict()}

    def load(self, directory: Path, optimizer, train_state: dict[str, Any]) -> None:
        """The model from `directory`'s model.safetensors, the optimizer from its train_state.pt (already verified)."""
        self.model.load_state_dict({k: v.to(self.device) for k, v in read_model(directory).items()})
        optimizer.load_state_dict(train_state["optimizer"])
