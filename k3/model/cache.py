"""Per-sequence decoding cache of the hybrid stack (docs/architecture.md §2.5, §3.3).

Legend: B sequences, S cached tokens, H heads, K/V head dims, P = H·K, W conv width.

KDA layers keep a fixed-size state: the last W-1 pre-conv q/k/v inputs and the fp32 recurrent state
S [B, H, K, V]. Gated MLA layers keep the compressed latent of every past token: [ĉ (kv_lora_rank) ;
k_pe (qk_rope_head_dim)], post-norm, in the activation dtype. This is the plain contiguous reference
cache; the inference engine pages the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KDAState:
    conv_q: torch.Tensor  # [B, W-1, P]
    conv_k: torch.Tensor  # [B, W-1, P]
    conv_v: torch.Tensor  # [B, W-1, P]
    recurrent: torch.Tensor  # [B, H, K, V] fp32


@dataclass
class MLALatent:
    latent: torch.Tensor  # [B, S, kv_lora_rank + qk_rope_head_dim]


class K3Cache:
    """One entry per decoder layer (None until the layer first runs) and the tokens seen per sequence.

    Sequences may have different lengths (ragged decoding with packed input, see `K3ForCausalLM.forward`);
    MLA latents are then padded rows, row n valid up to `lengths[n]`.
    """

    def __init__(self, num_layers: int, batch_size: int):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.batch_size = batch_size
        self.lengths = [0] * batch_size
        self.layers: list[KDAState | MLALatent | None] = [None] * num_layers

    @property
    def seq_len(self) -> int:
        """The common length of all sequences (ValueError when they differ)."""
        if len(set(self.lengths)) != 1:
            raise ValueError(f"the cached sequences have different lengths {self.lengths}")
        return self.lengths[0]

    def check_batch(self, batch_size: int) -> None:
        if batch_size != self.batch_size:
            raise ValueError(f"this cache holds {self.batch_size} sequences but the input has {batch_size} rows")


@dataclass
class PagedKDAState:
    """A decode step's view of KDA states kept in place in a pool of slots (the inference engine's pages):
    row n of the batch reads and advances slot `slots[n]`. Padding rows point at a scratch slot."""

    recurrent: torch.Tensor  # [slots, H, K, V] fp32 (inner dims contiguous; the slot stride may be larger)
    conv: torch.Tensor  # [slots, 3, W-1, P]: the q, k, v conv tails
    slots: torch.Tensor  # [B] int64


@dataclass
class PagedMLALatent:
    """A decode step's view of MLA latents kept in place in pages of `page_tokens` rows: row n's cached tokens
    0 … lengths[n]-1 live in pages block_table[n, 0], block_table[n, 1], …; the step writes its new latent at
    position lengths[n] (that page must exist) and attends over lengths[n] + 1 rows."""

    pages: torch.Tensor  # [P, page_tokens, C + R]
    block_table: torch.Tensor  # [B, max_blocks] int32 page ids (padding entries: any valid page)
    lengths: torch.Tensor  # [B] int32, cached tokens before this step
