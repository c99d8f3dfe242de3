"""The language-model loss, lm_head and cross-entropy together, without the logits of every token at once.

Legend: N tokens, D hidden width, V vocabulary.

    loss = Σ_{n : y_n ≠ ignore} [ logsumexp(W h_n) − (W h_n)[y_n] ]        (a sum; the caller divides)

`naive_linear_cross_entropy` is the reference: logits [N, V] from one GEMM (bf16 under autocast), cast to
fp32, `F.cross_entropy`. At the small preset's vocabulary (163,840) a 32K-token step holds 86 GB in the
bf16 logits, their fp32 copy and its gradient — more than the rest of the step.

`chunked_linear_cross_entropy` walks the tokens in chunks. For each chunk it computes the logits (the same
GEMM dtypes), the loss in fp32 and, when a gradient is wanted, the logit gradient softmax − onehot at once;
it folds that into dh (the chunk's rows) and dW (an fp32 sum over chunks) and frees the chunk. The backward
only scales dh and dW by the incoming gradient (a scalar, the loss is a sum). Peak extra memory is one chunk's
transients (about 2 GiB, by the path's chunk size below) plus dW; the work is the reference's three GEMMs.
Liger-Kernel's fused linear cross-entropy and Cut Cross-Entropy do the same in Triton; here the GEMMs stay on
cuBLAS and only the softmax and gradient are a Triton kernel (`rows_kernel`; docs/fast-paths.md says why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops import triton_runs_on
from k3.ops.weight_grads import accumulate_product, add_gradient

# elements of one chunk under the torch formula: 2^28 (1,638 rows at V = 163,840), whose transients are the
# fp32 logits (1 GiB), the 16-bit logits and their gradient: near 2 GiB. Each chunk adds its [V, D] product
# into dW once, a read and a write of the fp32 accumulator (503 MB at the small preset's head), so fewer,
# larger chunks move fewer bytes
CHUNK_ELEMENTS = 1 << 28
# bytes of one chunk's logits under the Triton row kernel: it overwrites the logits with their gradient in
# place, so they are the chunk's only transient, and 1 GiB holds 2x the rows in bf16 (2^29 elements, 3,121 rows
# at V = 163,840 over 21 even chunks of a 65,536-token step): half the passes over dW, and faster than 2^28 or
# 2^30 elements (`benchmarks.cross_entropy --rows-settings`)
CHUNK_BYTES_ROWS_KERNEL = 1 << 30


def naive_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100) -> torch.Tensor:
    """hidden [N, D], weight [V, D], labels [N] → the summed loss (fp32; fp64 for fp64 inputs)."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), labels, reduction="sum",
                           ignore_index=ignore_index)


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 ignore_index: int = -100, chunk_rows: int | None = None,
                                 rows_kernel: bool = False) -> torch.Tensor:
    """Same contract and GEMM dtypes as `naive_linear_cross_entropy` (autocast included), chunked.
    `rows_kernel`: each chunk's softmax and logit gradient by the Triton row kernel where Triton runs
    (bf16/fp16/fp32 logits), else the torch formula."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, D] and weight [V, D] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [N] = [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point:
        raise ValueError(f"labels must be integer class ids, got {labels.dtype}")
    device_type = hidden.device.type
    compute = hidden.dtype
    if torch.is_autocast_enabled(device_type) and hidden.dtype != torch.float64:
        compute = torch.get_autocast_dtype(device_type)  # what F.linear would run in
    rows_kernel = rows_kernel and _rows_kernel_runs(compute, hidden)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(hidden.shape[0], weight.shape[0], compute, rows_kernel)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    grad = torch.is_grad_enabled()
    wants = (grad and hidden.requires_grad, grad and weight.requires_grad)  # no gradient work for evaluation
    with torch.autocast(device_type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk_rows, compute, wants,
                                                rows_kernel)


def default_chunk_rows(N: int, V: int, dtype: torch.dtype, rows_kernel: bool) -> int:
    """Rows per chunk when the caller gives none: the path's budget (`CHUNK_ELEMENTS` for the torch formula,
    `CHUNK_BYTES_ROWS_KERNEL` of `dtype` logits for the row kernel), spread evenly over the chunks it takes."""
    elements = CHUNK_BYTES_ROWS_KERNEL // dtype.itemsize if rows_kernel else CHUNK_ELEMENTS
    return balanced_chunk_rows(N, max(1, elements // V))


def balanced_chunk_rows(N: int, limit: int) -> int:
    """At most `limit` rows per chunk, in as few chunks as that allows, of equal size: 65,536 tokens at 6,553
    rows are 11 chunks of 5,958, not 10 full ones and a 6-row tail that would cost a whole pass over dW."""
    chunks = max(1, -(-N // limit))
    return max(1, -(-N // chunks))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_rows, compute, wants, rows_kernel):
        acc = torch.float64 if compute == torch.float64 else torch.float32
        w = weight.to(compute)
        want_dh, want_dw = wants
        dh = torch.empty(hidden.shape, dtype=compute, device=hidden.device) if want_dh else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_dw else None
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            h = hidden[start:start + chunk_rows].to(compute)
            y = labels[start:start + chunk_rows]
            chunk_loss, grad = _loss_and_logit_grad(h @ w.T, y, ignore_index, want_dh or want_dw, acc, rows_kernel)
            loss += chunk_loss
            if want_dh:
                dh[start:start + chunk_rows] = grad @ w
            if want_dw:
                accumulate_product(dw, grad.T, h)
            del grad
        ctx.save_for_backward(dh, dw)
        ctx.hidden_dtype, ctx.weight = hidden.dtype, weight
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        # the scale (e.g. 1 / tokens) in fp32, not rounded to dh's bf16; out of place, so a retained graph
        # (gradcheck, a second backward) still sees the unscaled gradients
        grad_h = None if dh is None else (dh.to(grad_loss.dtype) * grad_loss).to(ctx.hidden_dtype)
        # added into the head's .grad where `k3.ops.weight_grads` accumulates (dw in the accumulation dtype)
        grad_w = None if dw is None else add_gradient(ctx.weight, dw, grad_loss)
        grad_w = None if grad_w is None else grad_w.to(ctx.weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _loss_and_logit_grad(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, want_grad: bool,
                         acc: torch.dtype, rows_kernel: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: logits [c, V] (the GEMM's dtype) -> (Σ loss over labelled rows in `acc`, the logit gradient
    softmax − onehot (zero rows where ignored) in the logits' dtype, or None). The Triton kernel where it
    runs (`rows_kernel`, decided by `_rows_kernel_runs`; it overwrites the logits with the gradient), the torch
    formula elsewhere: the same math."""
    if rows_kernel:
        return _loss_and_logit_grad_triton(logits, labels, ignore_index, want_grad)
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0).unsqueeze(1)
    full = logits.to(acc)
    lse = torch.logsumexp(full, dim=1)
    # torch.where, not a product: an ignored row with inf/NaN logits must not reach the sum
    loss = torch.where(valid, lse - full.gather(1, target).squeeze(1), 0).sum()
    if not want_grad:
        return loss, None
    grad = full.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the fp32 logits
    grad.scatter_add_(1, target, torch.full_like(lse, -1).unsqueeze(1))
    grad.masked_fill_(~valid.unsqueeze(1), 0)  # not a product: an ignored row's NaN stays out
    return loss, grad.to(logits.dtype)


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch formula
    triton = None


def _rows_kernel_runs(dtype: torch.dtype, t: torch.Tensor) -> bool:
    """The row kernel takes logits of this dtype on t's device."""
    return (triton is not None and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and triton_runs_on(t))


# The row kernel's launch; `python -m benchmarks.cross_entropy --rows-settings` times the alternatives. form "per_row":
# one program per row (its second sweep reads from DRAM again: the rows in flight, many programs of 320 KB each, exceed
# the 50 MB L2). "persistent": programs_per_sm x SMs programs, each striding over the rows, so that the rows in flight
# (about 132 x 320 KB at one per SM) can stay in L2 until the second sweep; its loads are pipelined `stages` tiles deep
# (tl.range num_stages; None: not pipelined) so one program per SM still streams at full bandwidth; reverse: its second
# sweep runs from the row's end back, so it first reads the tiles the first sweep read last (the ones most likely still
# in L2). With programs_per_sm x SMs >= rows it is one program per row again, with those two options. Both forms: BV the
# vocabulary tile width, warps per program. Untimed: the default is the measured launch.
LOSS_ROWS = dict(form="per_row", programs_per_sm=1, BV=4096, warps=8, stages=None, reverse=False)


if triton is not None:

    @triton.jit
    def _loss_row(L, Y, LOSS, row, V, stride, ignore_index, WRITE_GRAD: tl.constexpr, BV: tl.constexpr,
                  TILES: tl.constexpr, STAGES: tl.constexpr, REVERSE: tl.constexpr):
        """One row: an online logsumexp over V in BV-wide tiles (per-lane running max and sum, combined at the
        end), the row's loss, then — if asked — a second sweep that overwrites the row with softmax − onehot
        (zeros for an ignored row). Two reads and one write of the row in its dtype, against the torch formula's
        six fp32 passes."""
        base = L + row * stride
        y = tl.load(Y + row).to(tl.int64)
        valid = y != ignore_index
        m = tl.full([BV], float("-inf"), tl.float32)
        s = tl.zeros([BV], tl.float32)
        for tile in tl.range(TILES, num_stages=STAGES):  # TILES = ⌈V / BV⌉, fixed per vocabulary (one compile)
            cols = tile * BV + tl.arange(0, BV)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane with nothing yet: no inf − inf
            s = s * tl.exp(m - m_ref) + tl.exp(x - m_ref)
            m = m_new
        top = tl.max(m, axis=0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
        x_y = tl.load(base + tl.where(valid, y, 0)).to(tl.float32)
        tl.store(LOSS + row, tl.where(valid, lse - x_y, 0.0))
        if WRITE_GRAD:
            for step in tl.range(TILES, num_stages=STAGES):
                tile = (TILES - 1 - step) if REVERSE else step
                cols = tile * BV + tl.arange(0, BV)
                x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
                p = tl.exp(x - lse)
                p = tl.where(cols == y, p - 1.0, p)
                p = tl.where(valid, p, 0.0)
                tl.store(base + cols, p.to(L.dtype.element_ty), mask=cols < V)

    @triton.jit
    def _loss_rows_kernel(L, Y, LOSS, V, stride, ignore_index, WRITE_GRAD: tl.constexpr, BV: tl.constexpr,
                          TILES: tl.constexpr):
        """One row per program (form "per_row"), its loads not pipelined, both sweeps forward: the launch
        the H200 profiles measured. (The persistent kernel with at least as many programs as rows is this one
        with `stages` and `reverse`.)"""
        _loss_row(L, Y, LOSS, tl.program_id(0).to(tl.int64), V, stride, ignore_index, WRITE_GRAD, BV, TILES,
                  None, False)

    @triton.jit
    def _loss_rows_persistent_kernel(L, Y, LOSS, ROWS, V, stride, ignore_index, WRITE_GRAD: tl.constexpr,
                                     BV: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
                                     REVERSE: tl.constexpr):
        """Rows program_id, program_id + programs, … (form "persistent"): the rows in flight are one per
        program, however many rows the chunk has."""
        row = tl.program_id(0).to(tl.int64)
        # a while loop: the interpreter cannot take a range() whose bounds are tensors
        while row < ROWS:
            _loss_row(L, Y, LOSS, row, V, stride, ignore_index, WRITE_GRAD, BV, TILES, STAGES, REVERSE)
            row += tl.num_programs(0)


def _loss_and_logit_grad_triton(logits, labels, ignore_index, want_grad, settings=None):
    """logits [rows, V] (overwritten with the gradient when `want_grad`), labels [rows] -> (Σ loss fp32, the
    gradient or None). `settings`: a launch as in `LOSS_ROWS` (the default)."""
    cfg = LOSS_ROWS if settings is None else settings
    if cfg["form"] not in ("per_row", "persistent"):
        raise ValueError(f"LOSS_ROWS form must be per_row|persistent, got {cfg['form']!r}")
    rows, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        BV = min(cfg["BV"], triton.next_power_of_2(V))
        args = dict(WRITE_GRAD=want_grad, BV=BV, TILES=triton.cdiv(V, BV), num_warps=cfg["warps"])
        if cfg["form"] == "per_row":
            _loss_rows_kernel[(rows,)](logits, labels.contiguous(), losses, V, logits.stride(0), ignore_index,
                                       **args)
        else:
            programs = min(rows, cfg["programs_per_sm"] * _multiprocessors(logits.device))
            _loss_rows_persistent_kernel[(programs,)](logits, labels.contiguous(), losses, rows, V,
                                                      logits.stride(0), ignore_index, STAGES=cfg["stages"],
                                                      REVERSE=cfg["reverse"], **args)
    return losses.sum(), (logits if want_grad else None)


def _multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device; 1 in the interpreter (so tests choose the program count by `programs_per_sm`)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100, impl: str = "auto") -> torch.Tensor:
    """The summed LM loss. `impl`: "reference" | "chunked" | "triton" (chunked, each chunk's softmax and
    gradient by the Triton row kernel) | "auto" (triton on CUDA, the reference elsewhere)."""
    if impl == "auto":
        impl = "triton" if hidden.is_cuda else "reference"
    if impl == "reference":
        return naive_linear_cross_entropy(hidden, weight, labels, ignore_index)
    if impl in ("chunked", "triton"):
        return chunked_linear_cross_entropy(hidden, weight, labels, ignore_index, rows_kernel=impl == "triton")
    raise ValueError(f"loss impl must be auto|reference|chunked|triton, got {impl!r}")
