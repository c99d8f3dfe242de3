"""Quantization-aware training of the routed experts: MXFP4 weights, MXFP8 GEMM inputs (K3 report §4.1.4).

Legend: N tokens, k experts per token, E experts, M rows sorted by expert (padded), L latent width,
I expert hidden width.

Only the routed experts' three GEMMs are quantized; attention, the latent projections, shared experts, the dense
FFN, routers, embedding and head stay in the working precision (docs/qat.md). Per expert:

    y = fq8(SiTU-GLU(fq8(z) fq4(W1)ᵀ, fq8(z) fq4(W3)ᵀ)) fq4(W2)ᵀ,   out = Σ_j p_j · y_j

fq4 is MXFP4 (E2M1 elements, one E8M0 scale per 32 along the reduction dim: the last dim of W1, W3 [E, I, L]
and W2 [E, L, I]); fq8 is MXFP8 E4M3 with the same blocks along the last dim of z [N, L] and the activation
[., I]. Both are `k3.ops.mx.mx_fake_quantize` (quantize, then dequantize) under the configured scale mode.

- Straight-through estimator: the forward runs on the dequantized operands; the backward is the working-precision
  backward of the GEMMs at those operands, its gradient passed to the unquantized tensor unchanged (d fq(x)/dx := 1,
  no clipping mask: the report describes none).
- Where the rounding happens: weights in their own (master) dtype, then cast to the compute dtype — exact, an E2M1
  value times a power of two fits bf16 — so the exported MXFP4 bytes decode to exactly these values; GEMM inputs in
  the compute dtype (autocast's), the values the GEMM reads.
- The router weight p multiplies after the activation is quantized (the grouped path scales rows before its
  down-projection GEMM, on the quantized activation), so every path quantizes the same values.

The three forms of `k3.ops.moe`, with the quantizers in place:
- the reference: `LatentExperts.forward_reference` composes `fake_quantize_weight` / `fake_quantize_input`;
- `qat_grouped_latent_experts`: the grouped GEMMs with the MoE gradient transform (dp = ⟨dy·W2, fq8(act)⟩ from the
  recomputed activation, no expert output saved), its own autograd Function beside `_GroupedSituGLU`;
- `qat_gathered_latent_experts`: a decode step's few (token, expert) pairs, gathering only the chosen experts.
"""

from __future__ import annotations

import torch

from k3.ops.moe import (CUDA_ALIGN, _compute_dtype, _expert_weight_grads, _GatherRows, _ScatterRows, _source_rows,
                        _stack_gate_up, dispatch_plan, gmm)
from k3.ops.mx import BLOCK_SIZE, ScaleMode, mx_fake_quantize
from k3.ops.situ import naive_situ_glu, situ_glu, situ_glu_backward, situ_glu_forward

WEIGHT_ELEM = "e2m1"  # MXFP4
INPUT_ELEM = "e4m3"  # MXFP8


class _FakeQuantizeSTE(torch.autograd.Function):
    """mx_fake_quantize forward, identity backward."""

    @staticmethod
    def forward(ctx, x, elem, mode):
        return mx_fake_quantize(x, elem, BLOCK_SIZE, mode)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def fake_quantize_ste(x: torch.Tensor, elem: str, mode: ScaleMode) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) -> its MX fake quantization in x's dtype, with the straight-through gradient."""
    return _FakeQuantizeSTE.apply(x, elem, mode)


def fake_quantize_weight(w: torch.Tensor, mode: ScaleMode | None) -> torch.Tensor:
    """An expert weight [..., out, in] as its GEMM reads it under QAT: MXFP4 along `in`; unchanged for mode None."""
    return w if mode is None else fake_quantize_ste(w, WEIGHT_ELEM, mode)


def fake_quantize_input(x: torch.Tensor, mode: ScaleMode | None) -> torch.Tensor:
    """A GEMM input [..., K] under QAT: MXFP8 E4M3 along K, in x's dtype; unchanged for mode None."""
    return x if mode is None else fake_quantize_ste(x, INPUT_ELEM, mode)


def _quantized_activation(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float,
                          mode: ScaleMode) -> torch.Tensor:
    """fq8(SiTU-GLU(gate, up)) [M, I] in gate's dtype, no autograd."""
    return mx_fake_quantize(situ_glu_forward(gate, up, beta1, beta2), INPUT_ELEM, BLOCK_SIZE, mode)


class _QATGroupedSituGLU(torch.autograd.Function):
    """y = (p ⊙ fq8(SiTU-GLU(x fq4(W13)ᵀ))) fq4(W2)ᵀ per expert group: `k3.ops.moe._GroupedSituGLU` under QAT.

    x [M, L] in the compute dtype, already fq8 (rows of `fake_quantize_input(z)`); w1, w3 [G, I, L], w2 [G, L, I] the
    parameters (quantized here, then cast); p [M] fp32/fp64. Saves x, the pre-activations and the quantized weights;
    the activation and its quantization are recomputed in the backward. Weight gradients go to the parameters
    through `_expert_weight_grads` (the straight-through rule: the gradient at fq4(W) is W's).
    """

    @staticmethod
    def forward(ctx, x, offs, w1, w3, w2, probs, beta1, beta2, mode, native):
        ctx.params = (w1, w3, w2)
        w13 = _stack_gate_up(mx_fake_quantize(w1, WEIGHT_ELEM, BLOCK_SIZE, mode),
                             mx_fake_quantize(w3, WEIGHT_ELEM, BLOCK_SIZE, mode), x.dtype)  # [G, 2I, L]
        w2q = mx_fake_quantize(w2, WEIGHT_ELEM, BLOCK_SIZE, mode).to(x.dtype)  # [G, L, I]
        I = w2q.shape[-1]
        h = gmm(x, w13.transpose(1, 2), offs, native)  # [M, 2I]
        act = _quantized_activation(h[:, :I], h[:, I:], beta1, beta2, mode)
        y = gmm((act.to(probs.dtype) * probs[:, None]).to(x.dtype), w2q.transpose(1, 2), offs, native)  # [M, L]
        ctx.save_for_backward(x, offs, w13, w2q, h, probs)
        ctx.betas, ctx.mode, ctx.native = (beta1, beta2), mode, native
        return y

    @staticmethod
    def backward(ctx, dy):
        x, offs, w13, w2q, h, probs = ctx.saved_tensors
        native = ctx.native
        I = w2q.shape[-1]
        g, u = h[:, :I], h[:, I:]
        dy = dy.to(x.dtype)
        da = gmm(dy, w2q, offs, native).to(probs.dtype)  # [M, I]: the gradient into p ⊙ fq8(act)
        act = _quantized_activation(g, u, *ctx.betas, ctx.mode).to(probs.dtype)  # recomputed, never saved
        dprobs = (da * act).sum(-1)  # the MoE gradient transform at the quantized activation
        dh = torch.empty_like(h)  # [M, 2I] = [dg | du]
        situ_glu_backward(g, u, (da * probs[:, None]).to(x.dtype), *ctx.betas, out=dh)  # straight through fq8
        w1, w3, w2 = ctx.params
        need = ctx.needs_input_grad
        dw1 = dw2 = dw3 = None
        if need[4]:
            weighted = (act * probs[:, None]).to(x.dtype)  # the down-projection's input
            dw2, = _expert_weight_grads((w2,), dy.t(), weighted, offs, native)  # [G, L, I]
        dx = gmm(dh, w13, offs, native)  # [M, L]
        if need[2] or need[3]:
            dw1, dw3 = _expert_weight_grads((w1, w3), dh.t(), x, offs, native)
            dw1, dw3 = (dw1 if need[2] else None), (dw3 if need[3] else None)
        return dx, None, dw1, dw3, dw2, dprobs, None, None, None, None


def qat_grouped_latent_experts(z: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                               w3: torch.Tensor, w2: torch.Tensor, beta1: float, beta2: float, mode: ScaleMode,
                               align: int | None = None, native: bool | None = None) -> torch.Tensor:
    """`k3.ops.moe.grouped_latent_experts` under QAT (same contract, plus the scale `mode`): z [N, L],
    topk_idx [N, k], weights [N, k] -> Σ_j weights_j · E_j(z) [N, L] in fp32 (fp64 for fp64 inputs)."""
    k = topk_idx.shape[1]
    align = align or (CUDA_ALIGN if z.is_cuda else 1)
    dtype = _compute_dtype(z)
    accum = torch.float64 if z.dtype == torch.float64 else torch.float32
    dest, offs, rows = dispatch_plan(topk_idx, w1.shape[0], align)
    src = _source_rows(dest, k, rows)
    # quantize the N token rows once, then dispatch the k copies (padding rows stay zero)
    x = _ScatterRows.apply(fake_quantize_input(z.to(dtype), mode), dest, src, k)  # [M_pad, L]
    probs = weights.new_zeros(rows, dtype=accum).index_put((dest,), weights.reshape(-1).to(accum))
    y = _QATGroupedSituGLU.apply(x, offs, w1, w3, w2, probs, beta1, beta2, mode, native)  # [M_pad, L]
    return _GatherRows.apply(y, dest, src, k, accum)


def qat_gathered_latent_experts(z: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                                w3: torch.Tensor, w2: torch.Tensor, beta1: float, beta2: float,
                                mode: ScaleMode) -> torch.Tensor:
    """`k3.ops.moe.gathered_latent_experts` under QAT (same contract, plus the scale `mode`). Only the chosen
    experts' weights are quantized: MX blocks lie within a row, so fq4(W[e]) = fq4(W)[e]."""
    N, k = topk_idx.shape
    L = z.shape[1]
    flat = topk_idx.reshape(-1)
    dtype = _compute_dtype(z)
    accum = torch.float64 if z.dtype == torch.float64 else torch.float32

    def gathered(w: torch.Tensor) -> torch.Tensor:
        return fake_quantize_weight(w.index_select(0, flat), mode).to(dtype)  # [N·k, out, in]

    x = fake_quantize_input(z.to(dtype), mode)[:, None, :].expand(N, k, L).reshape(N * k, L, 1)  # [N·k, L, 1]
    gate = torch.bmm(gathered(w1), x)[..., 0]  # [N·k, I]
    up = torch.bmm(gathered(w3), x)[..., 0]
    act = fake_quantize_input((situ_glu if gate.is_cuda else naive_situ_glu)(gate, up, beta1, beta2), mode)
    y = torch.bmm(gathered(w2), act[..., None])[..., 0]  # [N·k, L]
    return (y.to(accum) * weights.reshape(-1, 1).to(accum)).view(N, k, -1).sum(1)
