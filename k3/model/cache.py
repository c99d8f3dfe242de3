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
