"""The language-model loss, lm_head and cross-entropy together, without the logits of every token at once.

Legend: N tokens, D hidden width, V vocabulary.

    loss = Σ_{n : y_n ≠ ignore} [ logsumexp(W h_n) − (W h_n)[y_n] ]        (a sum; the caller divides)

`naive_linear_cross_entropy` is the reference: logits [N, V] from one GEMM (bf16 under autocast), cast to
fp32, `F.cross_entropy`. At the small preset's vocabulary (163,840) a 32K-token step holds 86 GB in the
bf16 logits, their fp32 copy and its gradient — more than the rest of the step.

`chunked_linear_cross_entropy` walks the tokens in chunks. For each chunk it computes the logits (the same
GEMM dtypes), the loss in fp32 and, when a gradient is wanted, the logit gradient softmax − onehot at once;
it folds that into dh (the chunk's rows) and dW (an fp32 sum over chunks) and frees the chunk. The backward
only scales dh and dW by the incoming gradient (a scalar, the loss is a sum). Peak extra memory is one chunk
of fp32 logits plus dW; the work is the reference's three GEMMs. Liger-Kernel's fused linear cross-entropy
and Cut Cross-Entropy do the same in Triton; this one is plain PyTorch (docs/fast-paths.md says why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# elements of one chunk's fp32 logits: 2^28 (1 GiB; 1,638 rows at V = 163,840). Each chunk adds its [V, D]
# product into dW once, so fewer, larger chunks move fewer bytes; the chunk's transients (fp32 logits,
# bf16 logits and gradient) stay near 2 GiB
CHUNK_ELEMENTS = 1 << 28


def naive_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100) -> torch.Tensor:
    """hidden [N, D], weight [V, D], labels [N] → the summed loss (fp32; fp64 for fp64 inputs)."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), labels, reduction="sum",
                           ignore_index=ignore_index)


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 ignore_index: int = -100, chunk_rows: int | None = None) -> torch.Tensor:
    """Same contract and GEMM dtypes as `naive_linear_cross_entropy` (autocast included), chunked."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, D] and weight [V, D] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [N] = [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point:
        raise ValueError(f"labels must be integer class ids, got {labels.dtype}")
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_ELEMENTS // weight.shape[0])
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    device_type = hidden.device.type
    compute = hidden.dtype
    if torch.is_autocast_enabled(device_type) and hidden.dtype != torch.float64:
        compute = torch.get_autocast_dtype(device_type)  # what F.linear would run in
    grad = torch.is_grad_enabled()
    wants = (grad and hidden.requires_grad, grad and weight.requires_grad)  # no gradient work for evaluation
    with torch.autocast(device_type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk_rows, compute, wants)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_rows, compute, wants):
        acc = torch.float64 if compute == torch.float64 else torch.float32
        w = weight.to(compute)
        want_dh, want_dw = wants
        dh = torch.empty(hidden.shape, dtype=compute, device=hidden.device) if want_dh else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_dw else None
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            h = hidden[start:start + chunk_rows].to(compute)
            y = labels[start:start + chunk_rows]
            valid = y != ignore_index
            target = torch.where(valid, y, 0).unsqueeze(1)
            logits = (h @ w.T).to(acc)  # [c, V]
            lse = torch.logsumexp(logits, dim=1)
            # torch.where, not a product: an ignored row with inf/NaN logits must not reach the sum
            loss += torch.where(valid, lse - logits.gather(1, target).squeeze(1), 0).sum()
            if not (want_dh or want_dw):
                continue
            grad = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
            grad.scatter_add_(1, target, torch.full_like(lse, -1).unsqueeze(1))
            grad.mul_(valid.unsqueeze(1))
            grad = grad.to(compute)
            if want_dh:
                dh[start:start + chunk_rows] = grad @ w
            if want_dw:
                dw += grad.T @ h  # mixed-dtype in-place add: no fp32 copy of the [V, D] product
            del logits, grad
        ctx.save_for_backward(dh, dw)
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        grad_h = None if dh is None else (dh * grad_loss.to(dh.dtype)).to(ctx.hidden_dtype)
        grad_w = None if dw is None else (dw * grad_loss.to(dw.dtype)).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100, impl: str = "auto") -> torch.Tensor:
    """The summed LM loss. `impl`: "reference" | "chunked" | "auto" (chunked)."""
    if impl == "reference":
        return naive_linear_cross_entropy(hidden, weight, labels, ignore_index)
    if impl in ("auto", "chunked"):
        return chunked_linear_cross_entropy(hidden, weight, labels, ignore_index)
    raise ValueError(f"loss impl must be auto|reference|chunked, got {impl!r}")
