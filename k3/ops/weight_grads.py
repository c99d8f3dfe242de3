"""Weight gradients added into `.grad` where they are computed: gradient accumulation without the engine's passes.

With micro-batches, autograd delivers each 16-bit weight gradient by casting it to the fp32 master's dtype and
then `AccumulateGrad` adds it into `.grad`: two passes over every weight gradient per micro-batch, half of
them the casts (docs/fast-paths.md). Megatron-LM calls the remedy "gradient accumulation fusion":
the weight-gradient GEMM writes fp32 and adds into the accumulator in its epilogue (beta = 1), so the gradient is
never rounded to 16 bits, never cast, never re-read.

Here the autograd Functions that compute weight gradients (the fused projections, the routed experts, the loss's
head) call `add_product` / `add_gradient` with the leaf parameter. Inside `accumulating_weight_grads()` (which
`k3.train.loop.train_step` enters around its backward passes on one device) these add into `param.grad` and
return None, so the engine has nothing to cast or add; outside it they return the gradient as before. The
switch is process-wide, not thread-local, because the engine runs CUDA backward passes on its own thread.

Not for: `torch.autograd.grad` (it would find `.grad` changed instead of a returned gradient), sharded or
wrapped parameters (FSDP2, DTensor: `accumulates` is False for anything that is not a plain fp32 leaf), gradient
hooks on these parameters (they do not fire for a gradient added here), and autograd Functions whose backward runs
on a side stream (the engine synchronises the caller's stream with its own `AccumulateGrad` nodes only, so the
optimizer could read such a `.grad` early; every site here runs on the current stream). Tests:
`tests/ops/test_weight_grads.py` (every site, accumulated over micro-batches against the engine's gradients).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_ACCUMULATING = False
# "in_place": False turns the sites back to returning their gradients everywhere (the engine's casts and adds),
# for timing both in one process (`benchmarks/step_ab.py`) and as an escape hatch.
OPTIONS: dict = {"in_place": True}


@contextmanager
def accumulating_weight_grads(enabled: bool = True):
    """Within: weight gradients of the sites that support it are added into `.grad` where they are computed."""
    global _ACCUMULATING
    previous, _ACCUMULATING = _ACCUMULATING, enabled and OPTIONS["in_place"]
    try:
        yield
    finally:
        _ACCUMULATING = previous


def accumulates(param: torch.Tensor) -> bool:
    """Whether `param`'s gradient is added into its `.grad` here (the switch is on and it is a plain fp32 leaf
    whose `.grad`, if any, is a plain fp32 tensor of its shape)."""
    if not (_ACCUMULATING and type(param) in (torch.Tensor, torch.nn.Parameter) and param.is_leaf
            and param.requires_grad and param.dtype == torch.float32):
        return False
    grad = param.grad
    return grad is None or (type(grad) is torch.Tensor and grad.dtype == torch.float32 and grad.shape == param.shape)


def _fp32_epilogue_gemm(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether cuBLAS takes these 16-bit operands with an fp32 output (`out_dtype`, beta = 1 into it)."""
    return a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype


def fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32: on CUDA from 16-bit operands without rounding the product to 16 bits first."""
    return torch.mm(a, b, out_dtype=torch.float32) if _fp32_epilogue_gemm(a, b) else (a @ b).to(torch.float32)


def accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc in fp32 (or fp64) and a, b in a 16-bit GEMM dtype (or acc's). On CUDA the sum happens in
    cuBLAS's epilogue (beta = 1, fp32 output): one pass over acc instead of a 16-bit product and then an fp32
    read-modify-write, and the product skips the rounding to 16 bits (the loss's head sums its chunks' products this
    way, for the same reason). Elsewhere (CPU has no mixed-dtype GEMM) the product
    is rounded and added."""
    if acc.dtype == torch.float32 and _fp32_epilogue_gemm(a, b):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += a @ b


def add_product(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """`param`'s gradient a @ b ([out, in] = [out, n] @ [n, in]): added into `param.grad` in fp32 (on CUDA in the
    GEMM's epilogue, from 16-bit operands) and None returned when `accumulates(param)`; else a @ b returned."""
    if not accumulates(param):
        return a @ b
    if param.grad is None:
        param.grad = fp32_product(a, b)
    else:
        accumulate_product(param.grad, a, b)
    return None


def add_gradient(param: torch.Tensor, grad: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """`param`'s gradient `grad` (times `scale`, a scalar tensor, if given), computed already: added into
    `param.grad` (one pass, read in its own dtype) and None returned when `accumulates(param)`; else returned."""
    if not accumulates(param):
        return grad if scale is None else grad * scale.to(grad.dtype)
    if param.grad is None:  # a fresh fp32 tensor, never the caller's (a 0-dim scale does not promote: cast first)
        param.grad = (grad.to(torch.float32, memory_format=torch.contiguous_format, copy=True) if scale is None
                      else (grad.to(torch.float32) * scale.to(torch.float32)).contiguous())
    elif scale is None:
        param.grad.add_(grad)
    else:
        param.grad.addcmul_(grad, scale.to(torch.float32))
    return None
