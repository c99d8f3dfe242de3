"""Several linears of one input as one GEMM (the KDA layer's six input projections, a SiTU MLP's gate and up).

One launch and one read of x instead of one per linear, and in the backward one x-gradient GEMM instead of
one per linear plus the autograd engine's sums. The parameters stay apart, as the checkpoint names them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def fused_linears(x: torch.Tensor, linears: tuple[nn.Linear, ...], row_multiple: int = 1) -> tuple[torch.Tensor, ...]:
    """(lin(x) for lin in linears) from one GEMM over the concatenated weights: the outputs are column slices
    (row-strided views) of one [..., Σ out_features] tensor, whose width is padded with zero weight rows to a
    multiple of `row_multiple` elements (Triton proves a slice's rows 16-byte aligned only when the row stride
    is a multiple of 16). Bias-free linears only; the same function as calling each linear."""
    if any(lin.bias is not None for lin in linears):
        raise ValueError("fused_linears takes bias-free linears")
    device = x.device.type
    # under autocast each weight is cast first: concatenating the fp32 masters would copy them in full
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    weights = [lin.weight.to(dtype) for lin in linears]
    widths = [lin.out_features for lin in linears]
    pad = -sum(widths) % row_multiple
    if pad:
        weights.append(weights[0].new_zeros(pad, weights[0].shape[1]))
    return F.linear(x, torch.cat(weights)).split(widths + [pad], dim=-1)[:len(linears)]
