"""RMSNorm with fp32 statistics (docs/architecture.md conventions): w ⊙ x / sqrt(mean(x²) + ε), cast back.

`impl` ("auto" | "reference" | "triton", set from `config.norm_impl` by the model after construction)
picks the fused Triton kernels of `k3.ops.norm` on CUDA; the reference is the plain formula.
`gated_rms_norm` is RMSNorm followed by a sigmoid gate in one kernel (KDA's o_norm and output gate).
"""

import torch
from torch import nn

from k3.ops.norm import fused_norm_available, naive_rms_norm, rms_norm_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return naive_rms_norm(x, weight, eps)


def _fast(impl: str, x: torch.Tensor) -> bool:
    return impl == "triton" or (impl == "auto" and fused_norm_available(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, impl: str = "auto"):
        super().__init__()
        self.eps = eps
        self.impl = impl
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The norm in x's dtype, or written directly in `out_dtype` (no separate cast pass and its backward)."""
        if _fast(self.impl, x):
            return rms_norm_triton(x, self.weight, self.eps, out_dtype=out_dtype)
        return naive_rms_norm(x, self.weight, self.eps, out_dtype=out_dtype)

    def gated(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm(x) ⊙ σ(gate), in gate's dtype; x and gate [..., dim]."""
        return gated_rms_norm(x, self.weight, gate, self.eps, self.impl)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float,
                   impl: str = "auto") -> torch.Tensor:
    """RMSNorm(x; weight) ⊙ σ(gate): fused on CUDA (impl auto/triton), the reference formula otherwise."""
    if _fast(impl, x):
        return rms_norm_triton(x, weight, eps, gate)
    return naive_rms_norm(x, weight, eps, gate)
