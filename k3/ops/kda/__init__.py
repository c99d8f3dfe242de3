"""Kimi Delta Attention ops: the pure-PyTorch references (see reference.py and docs/kda.md)."""

from k3.ops.kda.chunk import torch_chunk_kda
from k3.ops.kda.reference import naive_chunk_kda, naive_kda_gate, naive_recurrent_kda

__all__ = ["naive_kda_gate", "naive_recurrent_kda", "naive_chunk_kda", "torch_chunk_kda"]
