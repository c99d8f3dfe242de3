"""SiTU-GLU, the bounded gated activation of every K3 FFN (K3 report §2.3.2, App. B).

    f(g, u) = [β1·tanh(g/β1)·σ(g)] · [β2·tanh(u/β2)],   β1 = 4, β2 = 25

It matches SwiGLU to first order (β·tanh(x/β) = x + O(x³/β²)), is bounded by β1·β2, and its gradient
never vanishes exactly. Evaluated in fp32 whatever the input dtype (bf16 differs visibly near
saturation), and the product is cast back once.

Two implementations of the same function:
- `naive_situ_glu`: plain PyTorch, differentiated by autograd (the reference; saves fp32 intermediates);
- `situ_glu`: one fused Triton kernel each way on CUDA (reads g and u once, writes f; the backward reads
  g, u, df and writes dg, du), saving only g and u. `situ_glu_forward` / `situ_glu_backward` are the
  same math without autograd, for callers that own their backward.
The routed experts use the row-weighted form a = p ⊙ f (p the router weight of each row):
`weighted_situ_glu_forward` (the forward kernel with `row_scale`) and `weighted_situ_glu_backward` (one
kernel returning dg, du, the weighted activation for the down-projection's weight gradient, and
dp = Σ da ⊙ f, the MoE gradient transform's router-weight gradient); their torch formulas are the reference.
Gradients: ∂f/∂g = [sech²(g/β1)σ(g) + β1 tanh(g/β1)σ(g)(1−σ(g))]·β2 tanh(u/β2),
∂f/∂u = β1 tanh(g/β1)σ(g)·sech²(u/β2).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the torch formulas below are used
    triton = None


def naive_situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """gate, up: same shape, any float dtype. Returns f(gate, up) in the input dtype."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    return _situ_value(gate, up, beta1, beta2).to(gate.dtype)


def _situ_value(gate, up, beta1, beta2):
    """f(gate, up) in fp32 (fp64 for fp64 inputs), not cast back."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u = gate.to(compute), up.to(compute)
    return (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)) * (beta2 * torch.tanh(u / beta2))


def _torch_backward(gate, up, grad, beta1, beta2):
    """The closed-form gradients in fp32 (fp64 for fp64 inputs); returns (dg, du) in the input dtype."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u, df = gate.to(compute), up.to(compute), grad.to(compute)
    tg, sg, tu = torch.tanh(g / beta1), torch.sigmoid(g), torch.tanh(u / beta2)
    a = beta1 * tg * sg
    dg = df * (beta2 * tu) * ((1 - tg * tg) * sg + a * (1 - sg))
    du = df * a * (1 - tu * tu)
    return dg.to(gate.dtype), du.to(up.dtype)


if triton is not None:

    @triton.jit
    def _tanh(x):
        # tanh(x) = 1 − 2/(e^{2x} + 1): saturates to ±1 without overflow; absolute error ~1 ulp of 1
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _load_tile(G, U, M, N, stride_g, stride_u, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's [BLOCK_M, BLOCK_N] tile: (int64 row index column, columns, mask, gate, up in fp32)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        r = rows[:, None].to(tl.int64)
        g = tl.load(G + r * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + r * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        return r, cols, mask, g, u

    @triton.jit
    def _situ_fwd_kernel(G, U, P, F, M, N, stride_g, stride_u, stride_f, beta1, beta2, HAS_P: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        r, cols, mask, g, u = _load_tile(G, U, M, N, stride_g, stride_u, BLOCK_M, BLOCK_N)
        f = (beta1 * _tanh(g / beta1) * tl.sigmoid(g)) * (beta2 * _tanh(u / beta2))
        if HAS_P:  # each row scaled by its fp32 weight before the one cast
            f *= tl.load(P + r, mask=r < M, other=0.0)
        tl.store(F + r * stride_f + cols[None, :], f.to(F.dtype.element_ty), mask=mask)

    @triton.jit
    def _situ_value_and_partials(g, u, beta1, beta2):
        """f(g, u) and its partials ∂f/∂g, ∂f/∂u (module docstring), in fp32."""
        tg = _tanh(g / beta1)
        sg = tl.sigmoid(g)
        tu = _tanh(u / beta2)
        a = beta1 * tg * sg
        return a * (beta2 * tu), (beta2 * tu) * ((1.0 - tg * tg) * sg + a * (1.0 - sg)), a * (1.0 - tu * tu)

    @triton.jit
    def _situ_bwd_kernel(G, U, DF, DG, DU, M, N, stride_g, stride_u, stride_df, stride_dg, stride_du,
                         beta1, beta2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        r, cols, mask, g, u = _load_tile(G, U, M, N, stride_g, stride_u, BLOCK_M, BLOCK_N)
        df = tl.load(DF + r * stride_df + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        _, f_g, f_u = _situ_value_and_partials(g, u, beta1, beta2)
        dg = df * f_g
        du = df * f_u
        tl.store(DG + r * stride_dg + cols[None, :], dg.to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + r * stride_du + cols[None, :], du.to(DU.dtype.element_ty), mask=mask)

    @triton.jit
    def _situ_weighted_bwd_kernel(G, U, DA, P, DG, DU, WACT, DP, M, N: tl.constexpr, stride_g, stride_u, stride_da,
                                  stride_dg, stride_du, stride_w, beta1, beta2,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Backward of a = p ⊙ f(g, u) per row, given da: dg, du (through df = p·da), the weighted activation
        p ⊙ f (what the down-projection's weight gradient needs) and dp = Σ_cols da ⊙ f. One program owns
        whole rows and walks their column tiles, so dp is summed in a fixed order (no atomics). N is a
        compile-time constant (one expert width per model), which also keeps the loop bound static."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        r = rows[:, None].to(tl.int64)
        p = tl.load(P + r, mask=r < M, other=0.0)
        dp = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c0 in range(0, N, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            g = tl.load(G + r * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            u = tl.load(U + r * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            da = tl.load(DA + r * stride_da + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            f, f_g, f_u = _situ_value_and_partials(g, u, beta1, beta2)
            dp += tl.sum(da * f, 1)
            df = da * p
            dg = df * f_g
            du = df * f_u
            tl.store(DG + r * stride_dg + cols[None, :], dg.to(DG.dtype.element_ty), mask=mask)
            tl.store(DU + r * stride_du + cols[None, :], du.to(DU.dtype.element_ty), mask=mask)
            tl.store(WACT + r * stride_w + cols[None, :], (f * p).to(WACT.dtype.element_ty), mask=mask)
        tl.store(DP + rows, dp, mask=rows < M)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A [*, N] tensor as a 2-D [M, N] view with unit column stride (copies only if it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


_BLOCK_M, _BLOCK_N = 16, 128


def situ_glu_forward_triton(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float,
                            out: torch.Tensor | None = None, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Fused forward. gate, up [..., N] (row-strided views allowed) -> f [..., N] in gate's dtype;
    with `row_scale` [M] fp32, row m is multiplied by row_scale[m] in fp32 before the cast."""
    g, u = _as_rows(gate), _as_rows(up)
    M, N = g.shape
    f = torch.empty(M, N, dtype=gate.dtype, device=gate.device) if out is None else out
    grid = (triton.cdiv(M, _BLOCK_M), triton.cdiv(N, _BLOCK_N))
    p = row_scale if row_scale is not None else g  # an unused pointer when HAS_P is off
    _situ_fwd_kernel[grid](g, u, p, f, M, N, g.stride(0), u.stride(0), f.stride(0), float(beta1), float(beta2),
                           HAS_P=row_scale is not None, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N)
    return f.view(gate.shape) if out is None else f


def situ_glu_backward_triton(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, beta1: float, beta2: float,
                             dgate: torch.Tensor | None = None, dup: torch.Tensor | None = None):
    """Fused backward. Returns (dg, du); `dgate`/`dup` may be given as [M, N] (row-strided) outputs."""
    g, u, df = _as_rows(gate), _as_rows(up), _as_rows(grad)
    M, N = g.shape
    dg = torch.empty(M, N, dtype=gate.dtype, device=gate.device) if dgate is None else dgate
    du = torch.empty(M, N, dtype=up.dtype, device=up.device) if dup is None else dup
    grid = (triton.cdiv(M, _BLOCK_M), triton.cdiv(N, _BLOCK_N))
    _situ_bwd_kernel[grid](g, u, df, dg, du, M, N, g.stride(0), u.stride(0), df.stride(0), dg.stride(0),
                           du.stride(0), float(beta1), float(beta2), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N)
    if dgate is None:
        dg, du = dg.view(gate.shape), du.view(up.shape)
    return dg, du


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and t.dtype in (torch.float32, torch.bfloat16, torch.float16)


def situ_glu_forward(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """f(gate, up) without autograd: the Triton kernel on CUDA, the torch formula elsewhere."""
    with torch.no_grad():
        if _use_triton(gate):
            return situ_glu_forward_triton(gate, up, beta1, beta2)
        return naive_situ_glu(gate, up, beta1, beta2)


def situ_glu_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, beta1: float, beta2: float,
                      out: torch.Tensor | None = None):
    """(dg, du) for upstream `grad`. With `out` [M, 2N] the two land in its halves (no concatenation)."""
    if _use_triton(gate):
        if out is None:
            return situ_glu_backward_triton(gate, up, grad, beta1, beta2)
        n = gate.shape[-1]
        return situ_glu_backward_triton(gate, up, grad, beta1, beta2, out[:, :n], out[:, n:])
    dg, du = _torch_backward(gate, up, grad, beta1, beta2)
    if out is not None:
        n = gate.shape[-1]
        out[:, :n].copy_(dg.reshape(-1, n))
        out[:, n:].copy_(du.reshape(-1, n))
    return dg, du


_WEIGHTED_BLOCK_M, _WEIGHTED_BLOCK_N = 8, 64  # whole rows per program; 96 registers at 8 × 64 (16 × 64: 255)


def weighted_situ_glu_forward(gate: torch.Tensor, up: torch.Tensor, row_scale: torch.Tensor, beta1: float,
                              beta2: float) -> torch.Tensor:
    """p ⊙ f(gate, up) without autograd: gate, up [M, N] (row-strided views allowed), row_scale p [M] fp32
    (fp64 for fp64 inputs) -> [M, N] in gate's dtype, the product taken in p's dtype and cast once."""
    with torch.no_grad():
        if _use_triton(gate) and row_scale.dtype == torch.float32:
            return situ_glu_forward_triton(gate, up, beta1, beta2, row_scale=row_scale.contiguous())
        return (_situ_value(gate, up, beta1, beta2).to(row_scale.dtype) * row_scale[:, None]).to(gate.dtype)


def weighted_situ_glu_backward_triton(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor,
                                      row_scale: torch.Tensor, beta1: float, beta2: float, out: torch.Tensor):
    """The fused kernel of `weighted_situ_glu_backward` (same contract; row_scale fp32)."""
    g, u, da = _as_rows(gate), _as_rows(up), _as_rows(grad)
    M, N = g.shape
    wact = torch.empty(M, N, dtype=gate.dtype, device=gate.device)
    dp = torch.empty(M, dtype=torch.float32, device=gate.device)
    dg, du = out[:, :N], out[:, N:]
    _situ_weighted_bwd_kernel[(triton.cdiv(M, _WEIGHTED_BLOCK_M),)](
        g, u, da, row_scale.contiguous(), dg, du, wact, dp, M, N, g.stride(0), u.stride(0), da.stride(0),
        dg.stride(0), du.stride(0), wact.stride(0), float(beta1), float(beta2),
        BLOCK_M=_WEIGHTED_BLOCK_M, BLOCK_N=_WEIGHTED_BLOCK_N)
    return wact, dp


def weighted_situ_glu_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, row_scale: torch.Tensor,
                               beta1: float, beta2: float, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of a = p ⊙ f(gate, up) for upstream `grad` = da [M, N].

    Writes [dgate | dup] into `out` [M, 2N] and returns (p ⊙ f in gate's dtype, dp [M] in p's dtype) with
    dp = Σ_n da ⊙ f: the router-weight gradient of the MoE gradient transform, from the activation and the
    gradient flowing into it. On CUDA one kernel reads g, u, da once (against ~8 fp32 passes of the torch
    formulas below, the reference).
    """
    if _use_triton(gate) and row_scale.dtype == torch.float32:
        return weighted_situ_glu_backward_triton(gate, up, grad, row_scale, beta1, beta2, out)
    N = gate.shape[-1]
    f = _situ_value(gate, up, beta1, beta2).to(row_scale.dtype)
    da = grad.to(row_scale.dtype)
    p = row_scale[:, None]
    dg, du = _torch_backward(gate, up, da * p, beta1, beta2)
    out[:, :N].copy_(dg)
    out[:, N:].copy_(du)
    return (f * p).to(gate.dtype), (da * f).sum(-1)


class _SiTUGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, beta1, beta2):
        ctx.save_for_backward(gate, up)
        ctx.betas = (beta1, beta2)
        return situ_glu_forward(gate, up, beta1, beta2)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        dg, du = situ_glu_backward(gate, up, grad, *ctx.betas)
        return dg, du, None, None


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """The fused SiTU-GLU (same contract as `naive_situ_glu`); saves only gate and up for the backward."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if up.dtype != gate.dtype:
        up = up.to(gate.dtype)
    return _SiTUGLU.apply(gate, up, beta1, beta2)
