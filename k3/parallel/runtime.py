"""Process groups, the device mesh and how a global batch is cut into per-rank pieces (docs/distributed.md).

Legend: W world size, dp data-parallel sharding degree, cp context-parallel degree, ep expert-parallel
degree; B rows and T tokens of the *global* batch.

One mesh `("dp", "cp")` with dp·cp = W. FSDP2 shards parameters over the flattened `dp_cp` dimension
(CP ranks hold the same parameters and distinct tokens, as in torchtitan). Expert parallelism borrows
ranks from dp × cp; ep = 1 (no EP) or ep = W (every rank is an EP rank) is supported, which covers one
node. Quantile Balancing, the loss token count and QK-Clip's max reduce over
the whole world: every rank holds distinct tokens.

The data layout does not depend on W: every rank builds the same global batch and keeps its piece, so a
run resumed on another number of ranks sees the same tokens in the same order (DCP resharding).
dp rank d keeps rows [d·B/dp, (d+1)·B/dp); cp rank c keeps the contiguous tokens [c·T/cp, (c+1)·T/cp)
of each of those rows (no head-tail layout: KDA needs contiguous segments).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from k3.parallel.context_parallel import BatchShard
from k3.parallel.parallelize import parallelize


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    cp: int = 1
    ep: int = 1

    def validate(self, world_size: int) -> None:
        if min(self.dp, self.cp, self.ep) < 1:
            raise ValueError(f"parallel degrees must be >= 1, got dp={self.dp} cp={self.cp} ep={self.ep}")
        if self.dp * self.cp != world_size:
            raise ValueError(f"dp × cp = {self.dp} × {self.cp} must equal the number of processes ({world_size})")
        if self.ep not in (1, world_size):
            raise ValueError(f"ep must be 1 or the number of processes ({world_size}) in this build, got {self.ep}")

    @classmethod
    def infer(cls, world_size: int, cp: int = 1, expert_parallel: bool = False) -> ParallelDims:
        """dp from the world size and the requested cp; expert parallelism over all ranks or none."""
        if cp < 1 or world_size % cp:
            raise ValueError(f"cp={cp} must divide the number of processes ({world_size})")
        dims = cls(dp=world_size // cp, cp=cp, ep=world_size if expert_parallel else 1)
        dims.validate(world_size)
        return dims


class ParallelRuntime:
    """The process group, mesh and sub-groups of one distributed run (one object per process)."""

    def __init__(self, dims: ParallelDims, device: torch.device):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call ParallelRuntime.from_env()")
        self.dims = dims
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        dims.validate(self.world_size)
        self.mesh: DeviceMesh = init_device_mesh(device.type, (dims.dp, dims.cp), mesh_dim_names=("dp", "cp"))
        self.fsdp_mesh: DeviceMesh = self.mesh._flatten("dp_cp")
        self.cp_group = self.mesh.get_group("cp")
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.cp_rank = self.mesh.get_local_rank("cp")

    @classmethod
    def from_env(cls, cp: int = 1, expert_parallel: bool = False,
                 device: str | torch.device | None = None) -> ParallelRuntime:
        """Join the group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR...): NCCL on GPUs, gloo on CPU."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10),
                                    device_id=device if device.type == "cuda" else None)
        dims = ParallelDims.infer(dist.get_world_size(), cp=cp, expert_parallel=expert_parallel)
        return cls(dims, device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        dist.barrier()

    def all_reduce_(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce over every rank (all hold distinct tokens)."""
        dist.all_reduce(tensor, op=op)
        return tensor

    def check_batch_layout(self, rows: int, seq_len: int) -> None:
        """A global batch of `rows` × `seq_len` must cut evenly: rows over dp, each row into cp slices longer than
        the KDA conv halo. Raises ValueError."""
        dp, cp = self.dims.dp, self.dims.cp
        if rows % dp:
            raise ValueError(f"stage seq_len {seq_len}: {rows} rows per micro-batch do not split over dp={dp}")
        if seq_len % cp or seq_len // cp < 4:
            raise ValueError(f"stage seq_len {seq_len} must split into cp={cp} slices of at least 4 tokens")

    def parallelize(self, model, moonep: bool = True, activation_checkpointing: bool = False):
        """EP → CP → activation checkpointing → FSDP2 on `model` (in place); returns its `ParallelTraining`."""
        return parallelize(model, self, moonep=moonep, activation_checkpointing=activation_checkpointing)

    def shard_batch(self, input_ids: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor):
        return shard_batch(input_ids, labels, cu_seqlens, self.dims.dp, self.dp_rank, self.dims.cp, self.cp_rank)


def shard_batch(input_ids: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor, dp: int, dp_rank: int,
                cp: int = 1, cp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BatchShard]:
    """This rank's piece of a global packed batch [B, T] (cu_seqlens [N+1] over B·T): its dp rank's rows and
    its cp rank's contiguous slice of them. Returns (input_ids, labels [B/dp, T/cp], local cu_seqlens, shard).

    The local `cu_seqlens` cut documents at the piece's edges: a document continuing from the previous cp
    rank starts at local offset 0.
    """
    B, T = input_ids.shape
    if B % dp:
        raise ValueError(f"the global batch has {B} rows, not divisible by dp={dp}")
    if T % cp:
        raise ValueError(f"sequence length {T} is not divisible by cp={cp}")
    rows = slice(dp_rank * (B // dp), (dp_rank + 1) * (B // dp))
    t_local = T // cp
    cols = slice(cp_rank * t_local, (cp_rank + 1) * t_local)
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths).view(B, T)
    seg_rows = segment[rows]  # [B_local, T]
    local_seg = seg_rows[:, cols]  # [B_local, t_local]
    flat = local_seg.reshape(-1)
    # a new local document wherever the global document changes, and at every row start
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[:: t_local] = True
    idx = torch.nonzero(starts).flatten()
    local_cu = torch.cat([idx, idx.new_tensor([flat.numel()])])
    shard = BatchShard(seg_rows, cp_rank * t_local, T, cp, cp_rank)
    return input_ids[rows, cols].contiguous(), labels[rows, cols].contiguous(), local_cu, shard
