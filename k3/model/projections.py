"""Several linears of one input as one GEMM (the KDA layer's six input projections, a SiTU MLP's gate and up).

One launch and one read of x instead of one per linear, and in the backward one x-gradient GEMM instead of
one per linear plus the autograd engine's sums. The parameters stay apart, as the checkpoint names them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.ops.weight_grads import accumulates, add_gradient, add_product, fp32_product


# Backward without the concatenated output gradient (`fused_linears`): output slices at least this wide get their
# own x-gradient GEMM, accumulated in place; narrower ones are concatenated for one GEMM. None: autograd's
# backward, which concatenates every slice's gradient. 1024 splits the KDA layer's q, k, v and gate and keeps
# β, the decay input and the shared MLP's 320-wide slices concatenated, where splitting them was slower
# (`benchmarks/fused_linears.py`, docs/fast-paths.md). dx is rounded to the activation dtype after each accumulated GEMM (one
# rounding per wide slice, as separate linears summed by autograd give), not once.
SPLIT_BACKWARD_WIDTH: int | None = 1024


class _FusedLinears(torch.autograd.Function):
    """y = x [W_1; …; W_n; 0]ᵀ, returned as the n column slices; the backward takes the slices' gradients as
    they come: dx = Σ_i dy_i W_i, dW_i = dy_iᵀ x. The weights come in as the parameters and are cast to x's
    dtype here, so the weight gradients can be added into `.grad` where `k3.ops.weight_grads` accumulates."""

    @staticmethod
    def forward(ctx, x, widths, pad, *params):
        ctx.params = params
        weights = tuple(p.to(x.dtype) for p in params)
        w = torch.cat(weights + ((weights[0].new_zeros(pad, weights[0].shape[1]),) if pad else ()))
        ctx.save_for_backward(x, *weights)
        ctx.set_materialize_grads(False)
        return F.linear(x, w).split(list(widths) + [pad], dim=-1)[:len(widths)]

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        params = ctx.params
        x2 = x.reshape(-1, x.shape[-1])
        given = [(i, g.reshape(-1, g.shape[-1])) for i, g in enumerate(grads) if g is not None]
        wide = [(i, g) for i, g in given if g.shape[-1] >= SPLIT_BACKWARD_WIDTH]
        narrow = [(i, g) for i, g in given if g.shape[-1] < SPLIT_BACKWARD_WIDTH]
        dws: list = [None] * len(weights)
        dx = None
        if narrow:
            g = torch.cat([g for _, g in narrow], dim=-1) if len(narrow) > 1 else narrow[0][1]
            w = torch.cat([weights[i] for i, _ in narrow]) if len(narrow) > 1 else weights[narrow[0][0]]
            dx = g @ w if ctx.needs_input_grad[0] else None
            if len(narrow) == 1 and ctx.needs_input_grad[3 + narrow[0][0]]:
                dws[narrow[0][0]] = add_product(params[narrow[0][0]], g.t(), x2)
            elif any(ctx.needs_input_grad[3 + i] for i, _ in narrow):
                # one GEMM for the narrow weights (small: adding their slices into .grad is cheap), in fp32 where
                # they accumulate in place
                fp32 = all(accumulates(params[i]) for i, _ in narrow)
                product = fp32_product(g.t(), x2) if fp32 else g.t() @ x2
                for (i, _), dw in zip(narrow, product.split([gi.shape[-1] for _, gi in narrow])):
                    if ctx.needs_input_grad[3 + i]:
                        dws[i] = add_gradient(params[i], dw)
        for i, g in wide:
            if ctx.needs_input_grad[0]:
                dx = g @ weights[i] if dx is None else dx.addmm_(g, weights[i])
            if ctx.needs_input_grad[3 + i]:
                dws[i] = add_product(params[i], g.t(), x2)
        if dx is not None:
            dx = dx.view(x.shape)
        elif ctx.needs_input_grad[0]:
            dx = torch.zeros_like(x)
        return (dx, None, None, *dws)


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
    widths = [lin.out_features for lin in linears]
    pad = -sum(widths) % row_multiple
    if SPLIT_BACKWARD_WIDTH is not None:
        with torch.autocast(device, enabled=False):
            return _FusedLinears.apply(x.to(dtype), tuple(widths), pad, *(lin.weight for lin in linears))
    weights = [lin.weight.to(dtype) for lin in linears]
    if pad:
        weights.append(weights[0].new_zeros(pad, weights[0].shape[1]))
    return F.linear(x, torch.cat(weights)).split(widths + [pad], dim=-1)[:len(linears)]
