"""How the tokens of one forward call are laid out: plain rows, or documents packed with `cu_seqlens`.

Legend: B rows, T tokens per row, N documents.

`cu_seqlens` holds offsets into the flattened B·T token stream (fla's convention). Every row boundary
must also be a document boundary, so a row of a packed batch is a list of whole documents. Nothing —
attention, KDA state, short-conv history — crosses a document boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceLayout:
    batch_size: int
    seq_len: int
    cu_seqlens: torch.Tensor | None = None  # [N+1] int32, offsets into B·T
    segment_ids: torch.Tensor | None = None  # [B, T] int64 document index of every token
    # ragged incremental decoding: tokens already cached for each document's sequence (B = 1)
    past_lengths: list[int] | None = None
    # cu_seqlens as host ints, read once here: kernels that plan on the host take these instead of copying
    # cu_seqlens back per layer (each such copy waits for the GPU)
    offsets: tuple[int, ...] | None = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def host_offsets(self) -> list[int]:
        """cu_seqlens as ints: the host copy when the layout has one (no device read)."""
        return list(self.offsets) if self.offsets is not None else self.cu_seqlens.tolist()

    def one_token_per_document(self) -> bool:
        """Packed, and every document holds exactly one token (a batched decode step)."""
        offsets = self.host_offsets() if self.packed else []
        return bool(offsets) and all(b - a == 1 for a, b in zip(offsets, offsets[1:]))

    @classmethod
    def build(cls, batch_size: int, seq_len: int, cu_seqlens: torch.Tensor | None, device) -> SequenceLayout:
        if cu_seqlens is None:
            return cls(batch_size, seq_len)
        given = torch.as_tensor(cu_seqlens)
        if given.dim() != 1 or given.numel() < 2 or given.dtype.is_floating_point:
            raise ValueError("cu_seqlens must be a 1-D integer tensor with at least two offsets")
        # read on the host once, before any copy to the device (a device tensor is read back: the one sync
        # of a packed forward); everything is checked on the host
        offsets = tuple(given.tolist())
        cu = to_device_without_waiting(given, device)
        total = batch_size * seq_len
        if offsets[0] != 0 or offsets[-1] != total:
            raise ValueError(f"cu_seqlens must start at 0 and end at B*T = {total}, got {offsets[0]} … {offsets[-1]}")
        if any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError("cu_seqlens must be non-decreasing")
        if not {r * seq_len for r in range(1, batch_size)} <= set(offsets):
            raise ValueError("with several rows, every row boundary (multiples of T) must be in cu_seqlens")
        cu = cu.to(torch.int64)
        lengths = cu[1:] - cu[:-1]
        segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=total)
        return cls(batch_size, seq_len, cu.to(torch.int32), segment.view(batch_size, seq_len), offsets=offsets)


def to_device_without_waiting(t: torch.Tensor, device) -> torch.Tensor:
    """t on `device`. A host tensor goes to CUDA from pinned memory, non-blocking: a copy from pageable memory
    first waits for every kernel queued before it (e.g. the previous training step's optimizer)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
