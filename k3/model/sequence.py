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

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @classmethod
    def build(cls, batch_size: int, seq_len: int, cu_seqlens: torch.Tensor | None, device) -> SequenceLayout:
        if cu_seqlens is None:
            return cls(batch_size, seq_len)
        cu = torch.as_tensor(cu_seqlens, device=device)
        if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point:
            raise ValueError("cu_seqlens must be a 1-D integer tensor with at least two offsets")
        cu = cu.to(torch.int64)
        total = batch_size * seq_len
        if int(cu[0]) != 0 or int(cu[-1]) != total:
            raise ValueError(f"cu_seqlens must start at 0 and end at B*T = {total}, got {int(cu[0])} … {int(cu[-1])}")
        if bool((cu[1:] < cu[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing")
        row_ends = torch.arange(1, batch_size, device=device) * seq_len
        if not bool(torch.isin(row_ends, cu).all()):
            raise ValueError("with several rows, every row boundary (multiples of T) must be in cu_seqlens")
        lengths = cu[1:] - cu[:-1]
        segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        return cls(batch_size, seq_len, cu.to(torch.int32), segment.view(batch_size, seq_len))
