"""SiTU-GLU, the bounded gated activation of every K3 FFN (architecture.md §5.3; K3 report §2.3.2, App. B).

    f(g, u) = [β1·tanh(g/β1)·σ(g)] · [β2·tanh(u/β2)],   β1 = 4, β2 = 25

It matches SwiGLU to first order (β·tanh(x/β) = x + O(x³/β²)), is bounded by β1·β2, and its gradient
never vanishes exactly. Evaluated in fp32 whatever the input dtype (bf16 differs visibly near
saturation), and the product is cast back once.
"""

import torch


def naive_situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """gate, up: same shape, any float dtype. Returns f(gate, up) in the input dtype."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u = gate.to(compute), up.to(compute)
    out = (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)) * (beta2 * torch.tanh(u / beta2))
    return out.to(gate.dtype)
