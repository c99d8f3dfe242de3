"""Kimi Delta Attention ops: the pure-PyTorch references (reference.py, torch_chunk.py; docs/kda.md) and the Triton
kernels (chunk.py and its stages chunk_*.py, fused_recurrent.py; docs/kda-kernels.md).

The Triton ops are imported on first use, so the references work without Triton installed and the CPU
interpreter (TRITON_INTERPRET=1) can be switched on before Triton is imported.
"""

from k3.ops.kda.reference import naive_chunk_kda, naive_kda_gate, naive_recurrent_kda
from k3.ops.kda.torch_chunk import torch_chunk_kda

__all__ = ["naive_kda_gate", "naive_recurrent_kda", "naive_chunk_kda", "torch_chunk_kda", "chunk_kda",
           "fused_recurrent_kda"]


def __getattr__(name: str):
    if name == "chunk_kda":
        from k3.ops.kda.chunk import chunk_kda

        return chunk_kda
    if name == "fused_recurrent_kda":
        from k3.ops.kda.fused_recurrent import fused_recurrent_kda

        return fused_recurrent_kda
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
