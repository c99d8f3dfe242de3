"""The Triton kernels of k3.ops (SiTU-GLU, the MoE's weighted SiTU-GLU, combine, dispatch and weight-gradient GEMMs,
RMSNorm / gated RMSNorm, the AttnRes reads, the router's top-k, the short conv + SiLU, the chunked loss's row kernel)
through the Triton interpreter on CPU, against fp64 references: forward and every gradient.

Not collected by name: tests/ops/test_triton_interpreter.py runs this file in a subprocess with TRITON_INTERPRET=1
(tests/interpreter.py), which must be set before triton is imported. Tolerances are relative RMSE
(‖a − b‖ / ‖b‖): fp32 ≤ 2e-6, bf16 ≤ 1e-2. The interpreter (triton 3.6) truncates fp32 → bf16 stores where a GPU
rounds to nearest, so bf16 results here carry about 1.3× a GPU's rounding error; "no worse than the unfused path"
is checked on the GPU.
"""

import pytest
import torch

from k3.model.attn_res import attn_res_read, block_reads
from k3.model.moe import LatentExperts
from k3.ops import cross_entropy, grouped_gemm, moe, short_conv
from k3.ops.attn_res import attn_res_read_triton
from k3.ops.cross_entropy import chunked_linear_cross_entropy, naive_linear_cross_entropy
from k3.ops.moe import sum_rows_triton
from k3.ops.norm import _row_view, naive_rms_norm, rms_norm_triton
from k3.ops.short_conv import naive_short_conv_silu, short_conv_silu
from k3.ops.situ import (naive_situ_glu, situ_glu_backward_triton, situ_glu_forward_triton,
                         weighted_situ_glu_backward_triton)
from tests.interpreter import INTERPRETING

if not INTERPRETING:
    pytest.skip("runs in the Triton interpreter's subprocess (test_triton_interpreter.py)", allow_module_level=True)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = pytest.mark.parametrize("dtype", [F32, BF16])
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


def check(name, got, ref, dtype, tol=None):
    err = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err <= (tol or TOL[dtype]) and torch.isfinite(got).all(), f"{name} ({dtype}): rel {err:.2e}"


def leaf(t, dtype=torch.float64):
    return t.detach().to(dtype).requires_grad_()


@DTYPES
def test_situ(dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 140, generator=g, dtype=torch.float64) * torch.tensor([6.0] * 70 + [40.0] * 70)
    gate, up = h[:, :70], h[:, 70:]  # row-strided views, as the MoE path passes them
    gr, ur = leaf(gate), leaf(up)
    ref = naive_situ_glu(gr, ur)
    df = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(df)
    hc = h.to(dtype)
    check("situ forward", situ_glu_forward_triton(hc[:, :70], hc[:, 70:], 4.0, 25.0), ref, dtype)
    dg, du = situ_glu_backward_triton(hc[:, :70], hc[:, 70:], df.to(dtype), 4.0, 25.0)
    check("situ d gate", dg, gr.grad, dtype)
    check("situ d up", du, ur.grad, dtype)


@DTYPES
def test_weighted_situ(dtype, M=45, N=70):
    """The MoE's row-weighted SiTU-GLU: a = p ⊙ f(g, u); forward, dg, du, dp and the weighted activation
    (columns not a multiple of the kernel's 64-column tile, rows not a multiple of its 8-row block)."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(M, 2 * N, generator=g, dtype=torch.float64) * torch.tensor([6.0] * N + [40.0] * N)
    p = torch.rand(M, generator=g, dtype=torch.float64)
    p[3] = 0.0  # a padding row
    gr, ur, pr = leaf(h[:, :N]), leaf(h[:, N:]), leaf(p)
    ref = naive_situ_glu(gr, ur) * pr[:, None]
    da = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(da)
    hc, pc = h.to(dtype), p.float()
    check("weighted situ forward", situ_glu_forward_triton(hc[:, :N], hc[:, N:], 4.0, 25.0, row_scale=pc), ref, dtype)
    out = torch.empty(M, 2 * N, dtype=dtype)
    wact, dp = weighted_situ_glu_backward_triton(hc[:, :N], hc[:, N:], da.to(dtype), pc, 4.0, 25.0, out)
    check("weighted situ d gate", out[:, :N], gr.grad, dtype)
    check("weighted situ d up", out[:, N:], ur.grad, dtype)
    check("weighted situ dp", dp, pr.grad, dtype)
    check("weighted situ p*act", wact, ref.detach(), dtype)
    assert dp.dtype == torch.float32 and wact.dtype == dtype


@DTYPES
def test_sum_rows(dtype, N=37, k=3, L=150):
    """The MoE combine: out[n] = Σ_j y[dest[n·k + j]] (fp32 sum), with padding rows in y that no token reads,
    N and L not multiples of the kernel's tiles, and y a row-strided view."""
    g = torch.Generator().manual_seed(3)
    rows = N * k + 11
    y = torch.randn(rows, L + 6, generator=g, dtype=torch.float64)[:, 3:L + 3]
    dest = torch.randperm(rows, generator=g)[:N * k]
    ref = y[dest].view(N, k, L).sum(1)
    for out_dtype in (torch.float32, dtype):
        got = sum_rows_triton(y.to(dtype), dest, k, out_dtype)
        assert got.dtype == out_dtype
        check(f"moe combine (sum of k rows) -> {out_dtype}", got, ref, dtype)
    # the dispatcher: fp64 never takes the fp32-accumulating kernel
    exact = moe._sum_rows(y, dest, k, torch.float64)
    assert exact.dtype == torch.float64 and ((exact - ref).abs().max() <= 1e-12 * ref.abs().max()), "fp64 combine"


@pytest.mark.parametrize("x_dtype, out_dtype", [(F32, F32), (BF16, BF16), (F32, BF16)])
def test_spread_rows(x_dtype, out_dtype, N=37, L=150, M=101):
    """The MoE dispatch's row spread (out[r] = x[src[r]], zero rows where src = N, cast while copying) against
    torch's gather: exact where the dtype stays, bf16 rounding where fp32 becomes bf16."""
    g = torch.Generator().manual_seed(N + L)
    x = (torch.randn(N, 2 * L, generator=g) * 3).to(x_dtype)[:, :L]  # a row-strided view
    src = torch.randint(0, N + 1, (M,), generator=g)
    src[:5] = N
    out = moe.spread_rows_triton(x, src, out_dtype)
    ref = torch.cat([x.double(), torch.zeros(1, L, dtype=torch.float64)]).index_select(0, src)
    tag = f"spread rows {x_dtype} -> {out_dtype}"
    if x_dtype == out_dtype:
        assert out.dtype == out_dtype and torch.equal(out.double(), ref), tag
    else:
        check(tag, out, ref, out_dtype)


@DTYPES
def test_grouped_wgrad(dtype):
    """The weight-gradient grouped GEMM against per-group fp64 products: empty groups, groups shorter and longer
    than a tile of rows, K, N and the rows not multiples of the tiles, a transposed (strided) operand."""
    g = torch.Generator().manual_seed(5)
    sizes = torch.tensor([0, 8, 40, 0, 136, 1, 24, 0])
    offs = sizes.cumsum(0).to(torch.int32)
    M, K, N = int(offs[-1]), 48, 80
    a = torch.randn(M, K, generator=g, dtype=torch.float64)
    dy = torch.randn(M, N, generator=g, dtype=torch.float64)
    ref = grouped_gemm.grouped_mm_wgrad_reference(dy.t(), a, offs)
    tiles = dict(BM=32, BN=32, BK=16, warps=4, stages=2)
    for cfg in (tiles, dict(tiles, BK=32)):
        got = grouped_gemm.grouped_mm_wgrad(dy.t().to(dtype), a.to(dtype), offs, cfg)
        check(f"grouped_mm_wgrad BK={cfg['BK']}", got, ref, dtype)
        assert got[0].abs().max() == 0 and got[3].abs().max() == 0, "an empty group's weight gradient is zero"


@DTYPES
def test_grouped_wgrad_into(dtype):
    """The weight-gradient kernel writing two fp32 outputs (rows split at 20, inside a 32-row tile) and then
    adding a second product into them, against the fp64 per-group products."""
    g = torch.Generator().manual_seed(6)
    sizes = torch.tensor([0, 8, 40, 136, 1])
    offs = sizes.cumsum(0).to(torch.int32)
    M, K, N = int(offs[-1]), 48, 40
    a, a2 = (torch.randn(M, K, generator=g, dtype=torch.float64) for _ in range(2))
    dy, dy2 = (torch.randn(M, N, generator=g, dtype=torch.float64) for _ in range(2))
    first = grouped_gemm.grouped_mm_wgrad_reference(dy.t(), a, offs)
    second = first + grouped_gemm.grouped_mm_wgrad_reference(dy2.t(), a2, offs)
    outs = [torch.full((5, rows, K), float("nan")) for rows in (20, 20)]
    tiles = dict(BM=32, BN=32, BK=16, warps=4, stages=2)
    grouped_gemm.grouped_mm_wgrad_into(dy.t().to(dtype), a.to(dtype), offs, outs, False, tiles)
    check("grouped_mm_wgrad_into, two outputs", torch.cat(outs, 1), first, dtype)
    grouped_gemm.grouped_mm_wgrad_into(dy2.t().to(dtype), a2.to(dtype), offs, outs, True, tiles)
    check("grouped_mm_wgrad_into, accumulated", torch.cat(outs, 1), second, dtype)


def test_experts_accumulating_weight_grads():
    """Two micro-batches through the expert function inside `accumulating_weight_grads` (the Triton weight-gradient
    kernel writing w1's and w3's .grad, then adding into them): the same .grad as the engine's sum of the two
    backward passes (fp32, within the kernel's fp32 rounding)."""
    from k3.ops.weight_grads import accumulating_weight_grads
    E, L, I, N, k = 8, 32, 24, 50, 3
    torch.manual_seed(13)
    experts = LatentExperts(E, L, I, 4.0, 25.0)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.2)
    batches = [(torch.randn(N, L), torch.stack([torch.randperm(E)[:k] for _ in range(N)]), torch.rand(N, k),
                torch.randn(N, L)) for _ in range(2)]
    params = [experts.w1, experts.w3, experts.w2]

    def run(accumulate):
        for p in params:
            p.grad = None
        calls = []
        kernel = grouped_gemm.grouped_mm_wgrad_into
        grouped_gemm.grouped_mm_wgrad_into = lambda *a: calls.append(1) or kernel(*a)
        moe.GROUPED_WGRAD = "triton"
        try:
            for z, idx, w, dy in batches:
                with accumulating_weight_grads(accumulate):
                    moe.grouped_latent_experts(z, idx, w, *params, 4.0, 25.0, align=8, native=True).backward(dy)
        finally:
            moe.GROUPED_WGRAD, grouped_gemm.grouped_mm_wgrad_into = "auto", kernel
        return [p.grad.clone() for p in params], len(calls)

    engine, engine_calls = run(False)
    fused, fused_calls = run(True)
    assert engine_calls == 0 and fused_calls == 4, (engine_calls, fused_calls)
    for name, a, b in zip(("w1", "w3", "w2"), fused, engine):
        check(f"experts accumulated d{name}", a, b.double(), torch.float32, tol=1e-6)


def test_experts_triton_wgrad():
    """The whole expert function with the Triton weight-gradient GEMMs (GROUPED_WGRAD = "triton", the other
    GEMMs through torch._grouped_mm as on CUDA, fp32) against the fp64 reference dispatch."""
    E, L, I, N, k = 8, 32, 24, 50, 3
    torch.manual_seed(12)
    experts = LatentExperts(E, L, I, 4.0, 25.0).double()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.2)
    z = torch.randn(N, L, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    idx[:20] = torch.tensor([0, 1, 2])  # skew: three experts take extra rows
    w = torch.rand(N, k, dtype=torch.float64)
    params = [leaf(z), leaf(w), experts.w1, experts.w3, experts.w2]
    ref = experts.forward_reference(params[0], idx, params[1])
    dy = torch.randn_like(ref)
    grads = torch.autograd.grad(ref, params, dy)
    fast = [leaf(t, torch.float32) for t in params]
    calls = []
    kernel = grouped_gemm.grouped_mm_wgrad
    grouped_gemm.grouped_mm_wgrad = lambda *a: calls.append(1) or kernel(*a)
    moe.GROUPED_WGRAD = "triton"
    try:
        out = moe.grouped_latent_experts(fast[0], idx, fast[1], *fast[2:], 4.0, 25.0, align=8, native=True)
        got = torch.autograd.grad(out, fast, dy.float())
    finally:
        moe.GROUPED_WGRAD, grouped_gemm.grouped_mm_wgrad = "auto", kernel
    assert len(calls) == 2, "the Triton weight-gradient GEMMs were not the path taken"
    check("experts (Triton dW) forward", out, ref, torch.float32, tol=1e-5)
    for name, a, b in zip(("z", "weights", "w1", "w3", "w2"), got, grads):
        check(f"experts (Triton dW) d{name}", a, b, torch.float32, tol=1e-5)


@DTYPES
@pytest.mark.parametrize("D, gated", [(96, False), (130, True), (64, True)])
def test_norm(dtype, D, gated):
    g = torch.Generator().manual_seed(D)
    x = torch.randn(3, 13, D, generator=g, dtype=torch.float64) * 3
    w = 1 + 0.2 * torch.randn(D, generator=g, dtype=torch.float64)
    gate = torch.randn(3, 13, D, generator=g, dtype=torch.float64) * 2 if gated else None
    xr, wr = leaf(x), leaf(w)
    gr = leaf(gate) if gated else None
    ref = naive_rms_norm(xr, wr, 1e-5, gr)
    dy = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(dy)
    xt, wt = leaf(x, dtype), leaf(w, torch.float32)
    gt = leaf(gate, dtype) if gated else None
    out = rms_norm_triton(xt, wt, 1e-5, gt)
    out.backward(dy.to(out.dtype))
    tag = f"{'gated ' if gated else ''}rmsnorm D={D}"
    check(tag + " forward", out, ref, dtype)
    check(tag + " dx", xt.grad, xr.grad, dtype)
    check(tag + " dw", wt.grad, wr.grad, dtype)
    if gated:
        check(tag + " dgate", gt.grad, gr.grad, dtype)


def test_norm_out_dtype(D=96):
    """fp32 x written as bf16 by the norm itself (the routed experts' latent norm): as the reference rounded once."""
    g = torch.Generator().manual_seed(D + 1)
    x = torch.randn(5, 11, D, generator=g, dtype=torch.float64) * 3
    w = 1 + 0.2 * torch.randn(D, generator=g, dtype=torch.float64)
    xr, wr = leaf(x), leaf(w)
    ref = naive_rms_norm(xr, wr, 1e-5)
    dy = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(dy)
    xt, wt = leaf(x, torch.float32), leaf(w, torch.float32)
    out = rms_norm_triton(xt, wt, 1e-5, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    out.backward(dy.to(out.dtype))
    assert xt.grad.dtype == torch.float32
    check(f"rmsnorm fp32 -> bf16 D={D} forward", out, ref, torch.bfloat16)
    check(f"rmsnorm fp32 -> bf16 D={D} dx", xt.grad, xr.grad, torch.bfloat16)
    check(f"rmsnorm fp32 -> bf16 D={D} dw", wt.grad, wr.grad, torch.bfloat16)


@DTYPES
def test_norm_strided(dtype, H=3, D=16):
    """x and the gate as KDA hands them over: column slices of wider projection rows, split into H heads
    ([B, T, H, D] views of row stride W), read in place; their gradients land in those columns only."""
    g = torch.Generator().manual_seed(H * D)
    W = 2 * H * D + 7
    wide = torch.randn(2, 9, W, generator=g, dtype=torch.float64) * 2
    w = 1 + 0.2 * torch.randn(D, generator=g, dtype=torch.float64)
    dy = torch.randn(2, 9, H, D, generator=g, dtype=torch.float64)

    def views(t):
        return t[..., 3:3 + H * D].view(2, 9, H, D), t[..., 5 + H * D:5 + 2 * H * D].view(2, 9, H, D)

    wr, wdr = leaf(wide), leaf(w)
    ref = naive_rms_norm(*views(wr)[:1], wdr, 1e-5, views(wr)[1])
    ref.backward(dy)
    wt, wdt = leaf(wide, dtype), leaf(w, torch.float32)
    x, gate = views(wt)
    assert x.stride() == (9 * W, W, D, 1) and _row_view(x)[0] is x and _row_view(x)[1] == (H, W, D)  # no copy
    out = rms_norm_triton(x, wdt, 1e-5, gate)
    out.backward(dy.to(out.dtype))
    check("gated rmsnorm, strided head views forward", out, ref, dtype)
    check("gated rmsnorm, strided head views d wide", wt.grad, wr.grad, dtype)
    check("gated rmsnorm, strided head views dw", wdt.grad, wdr.grad, dtype)
    # and an ungated column slice whose rows flatten to one stride
    xr = leaf(wide[..., 1:1 + D].double())
    ref = naive_rms_norm(xr, wdr.detach(), 1e-5)
    out = rms_norm_triton(wide.to(dtype)[..., 1:1 + D], wdt.detach(), 1e-5)
    check("rmsnorm, column slice forward", out, ref, dtype)


@pytest.mark.parametrize("dtype, n, D, one_row", [(F32, 2, 80, False), (F32, 3, 100, False), (F32, 5, 64, False),
                                                 (BF16, 4, 96, False), (F32, 3, 100, True)])
def test_attn_res(dtype, n, D, one_row):
    """The fused read against the stacked fp64 reference; `one_row`: one row per program on one warp (the GPU's
    launch at D ≤ 1024, which the interpreter skips)."""
    from k3.ops import attn_res as ops_attn_res

    saved = dict(ops_attn_res.READ_TILES)
    if one_row:
        ops_attn_res.READ_TILES.update(block_m=1, num_warps=1)
    try:
        _attn_res(dtype, n, D, " one row" if one_row else "")
    finally:
        ops_attn_res.READ_TILES.update(saved)


def _attn_res(dtype, n, D, label):
    g = torch.Generator().manual_seed(10 * n + D)
    # sources of very different scales (the keys are RMS-normalised, the values are not)
    sources = [torch.randn(2, 7, D, generator=g, dtype=torch.float64) * (1 + 3 * i) for i in range(n)]
    w = torch.randn(D, generator=g, dtype=torch.float64) * 0.5
    sr, wr = [leaf(s) for s in sources], leaf(w)
    ref = attn_res_read(wr, sr)
    dy = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(dy)
    st, wt = [leaf(s, dtype) for s in sources], leaf(w, torch.float32)
    out = attn_res_read_triton(wt, st)
    out.backward(dy.to(dtype))
    tag = f"attn_res n={n} D={D}{label}"
    check(tag + " forward", out, ref, dtype)
    check(tag + " dw", wt.grad, wr.grad, dtype)
    for i in range(n):
        check(tag + f" d source {i}", st[i].grad, sr[i].grad, dtype)


# one sealed source (block 0), J not a power of two, D not a multiple of the 64-column chunks, K3's J = 25
@pytest.mark.parametrize("dtype, n, J, D", [(F32, 1, 3, 64), (F32, 3, 5, 80), (F32, 4, 7, 96),
                                            (F32, 2, 25, 40), (BF16, 4, 7, 96)])
def test_attn_res_two_phase(dtype, n, J, D):
    """The fused two-phase form (one phase 1 over n sealed sources for J queries, then J merges with partial
    sums) against the torch form in fp64 on the same (dtype-rounded) values: the first query's phase-1 output
    is used directly, as the model's first read of a block is. Query gradients sum ds·r·v over every row and
    source (with cancellation): fp32 ≤ 1e-5 for those."""
    g = torch.Generator().manual_seed(100 * n + J + D)
    sealed = [(torch.randn(2, 7, D, generator=g, dtype=torch.float64) * (1 + 2 * i)).to(dtype) for i in range(n)]
    partials = [(torch.randn(2, 7, D, generator=g, dtype=torch.float64) * 3).to(dtype) for _ in range(J)]
    queries = torch.randn(J, D, generator=g, dtype=torch.float64) * 0.5
    merge_w = torch.randn(J, D, generator=g, dtype=torch.float64) * 0.5
    douts = [torch.randn(2, 7, D, generator=g, dtype=torch.float64) for _ in range(J + 1)]

    def run(src_dtype, fused):
        srcs, parts = [leaf(s, src_dtype) for s in sealed], [leaf(p, src_dtype) for p in partials]
        q_dtype = torch.float32 if fused else torch.float64  # the model's queries are fp32 parameters
        q, w = leaf(queries, q_dtype), leaf(merge_w, q_dtype)
        read = block_reads(q, srcs, fused)
        outs = [read(0, None, None)] + [read(j, w[j], parts[j]) for j in range(J)]
        sum((o.double() * d).sum() for o, d in zip(outs, douts)).backward()
        return outs, srcs, parts, q, w

    ref, r_srcs, r_parts, r_q, r_w = run(torch.float64, False)
    out, srcs, parts, q, w = run(dtype, True)
    tag = f"attn_res two-phase n={n} J={J} D={D}"
    for j in range(J + 1):
        check(tag + f" out {j}", out[j], ref[j], dtype)
    for i in range(n):
        check(tag + f" d sealed {i}", srcs[i].grad, r_srcs[i].grad, dtype)
    for j in range(J):
        check(tag + f" d partial {j}", parts[j].grad, r_parts[j].grad, dtype)
    qtol = 1e-5 if dtype == torch.float32 else None
    check(tag + " d phase-1 queries", q.grad, r_q.grad, dtype, qtol)
    check(tag + " d merge queries", w.grad, r_w.grad, dtype, qtol)


@pytest.mark.parametrize("dtype, D", [(F32, 96), (BF16, 64)])
def test_attn_res_sealed(dtype, D):
    """Sealed sources (`seal_source`) read by a chain of fused reads, as the model reads its blocks: their gradients
    summed inside the reads' kernels (every later read adds into the first one's buffer) against the fp64 torch
    reads, whose gradients autograd sums; a partial sum that is also used outside the reads, and a sealed source
    with a second consumer of its own (its gradient = the engine's + the sink's)."""
    from k3.ops import attn_res as ops_attn_res

    g = torch.Generator().manual_seed(D)
    blocks = [torch.randn(2, 5, D, generator=g, dtype=torch.float64) * (1 + i) for i in range(3)]
    partial = torch.randn(2, 5, D, generator=g, dtype=torch.float64) * 2
    queries = torch.randn(4, D, generator=g, dtype=torch.float64) * 0.5
    douts = [torch.randn(2, 5, D, generator=g, dtype=torch.float64) for _ in range(4)]
    masks = []
    launch = ops_attn_res._ar_bwd_kernel

    class Recording:  # the backward kernel's launches, to see that later reads accumulate
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                masks.append(kwargs["ACCUMULATE"])
                return launch[grid](*args, **kwargs)
            return run

    def run(src_dtype, fused):
        srcs, p = [leaf(b, src_dtype) for b in blocks], leaf(partial, src_dtype)
        q = leaf(queries, torch.float32 if fused else torch.float64)
        read = attn_res_read_triton if fused else attn_res_read
        sealed = [ops_attn_res.seal_source(s) if fused else s for s in srcs]
        outs = [read(q[0], sealed[:1] + [p]), read(q[1], sealed[:2] + [p]), read(q[2], sealed + [p]),
                read(q[3], sealed[1:] + [p])]
        total = sum((o.double() * d).sum() for o, d in zip(outs, douts))
        total = total + (sealed[2].double() ** 2).sum() + (p.double() * 3).sum()  # consumers outside the reads
        total.backward()
        return outs, srcs, p, q

    ref, r_srcs, r_p, r_q = run(torch.float64, False)
    ops_attn_res._ar_bwd_kernel = Recording()
    try:
        out, srcs, p, q = run(dtype, True)
    finally:
        ops_attn_res._ar_bwd_kernel = launch
    tag = f"attn_res sealed D={D}"
    for j in range(4):
        check(tag + f" out {j}", out[j], ref[j], dtype)
    for i in range(3):
        check(tag + f" d sealed {i}", srcs[i].grad, r_srcs[i].grad, dtype)
    check(tag + " d partial", p.grad, r_p.grad, dtype)
    check(tag + " d queries", q.grad, r_q.grad, dtype, 1e-5 if dtype == torch.float32 else None)
    # backward order: read 3 (sealed 1, 2 new), 2 (0 new; 1, 2 add), 1 (0, 1 add), 0 (0 adds); the partial never
    assert masks == [0b000, 0b0110, 0b011, 0b01], f"{tag}: accumulate masks {[bin(m) for m in masks]}"


def debug_model_gradients(model, ids):
    """Random AttnRes queries (zero-initialised ones make every read a plain mean), then one forward and backward
    of the next-token loss: {"logits": ..., parameter name: gradient}."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("_res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(pname))))
    logits = model(ids).logits
    vocab = logits.shape[-1]
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1)).backward()
    return {"logits": logits, **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def test_model_sealed_reads():
    """The debug model in fp64 with the fused direct reads (`attn_res_impl="triton"`; fp32 inside the kernels),
    its sealed sources summing their gradients in the kernels, against (a) the torch reads: logits ≤ 2e-6, every
    parameter gradient ≤ 5e-4 (the fused read's own fp32 rounding, amplified through five layers' backward:
    1.6e-4 at most when written, with or without sealing; a wrong or missing term shows as 1e-2 or more) and
    (b) the same fused reads with the engine summing per-read gradients: ≤ 1e-6 (only the order of the sums
    differs), and (c) the sealed run under activation checkpointing: ≤ 1e-12."""
    from k3.config import get_preset
    from k3.model import model as model_module
    from k3.model.checkpointing import apply_activation_checkpointing
    from k3.model.model import build_model
    from k3.ops import attn_res as ops_attn_res

    config = get_preset("debug").replace(vision_config=None)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(6))
    seal, sinks = model_module.seal, []

    def counting_seal(source, read):  # the sealed run's sinks, to see that they were used
        sealed = seal(source, read)
        sinks.append(getattr(sealed, ops_attn_res._SINK_ATTRIBUTE, None))
        return sealed

    runs = {}
    try:
        for name, impl, sealing in (("torch", "direct", seal), ("fused", "triton", lambda s, r: s),
                                    ("sealed", "triton", counting_seal), ("checkpointed", "triton", seal)):
            model_module.seal = sealing
            model = build_model(config.replace(attn_res_impl=impl), seed=4, dtype=torch.float64)
            if name == "checkpointed":  # the recomputed layers seal again; the sums must still reach autograd
                apply_activation_checkpointing(model)
            runs[name] = debug_model_gradients(model, ids)
    finally:
        model_module.seal = seal
    # 5 layers in blocks of 2
    assert len(sinks) == 3 and all(s is not None and s.grad is None for s in sinks), \
        f"model sealed reads: sinks {sinks} (expected 3, emptied by the backward)"
    for key, ref in runs["torch"].items():
        assert key in runs["sealed"], f"model sealed reads: no gradient for {key}"
        if ref.abs().sum() > 0:
            check(f"model sealed reads {key}", runs["sealed"][key], ref, torch.float32,
                  2e-6 if key == "logits" else 5e-4)
            check(f"model sealed vs unsealed {key}", runs["sealed"][key], runs["fused"][key], torch.float32, 1e-6)
            check(f"model sealed, checkpointed {key}", runs["checkpointed"][key], runs["sealed"][key],
                  torch.float32, 1e-12)


@pytest.mark.parametrize("N, E, k", [(3, 64, 8), (77, 64, 8), (9, 896, 16), (5, 10, 1)])
def test_topk_cutoff(N, E, k):
    """The router's fused top-k + cutoff against torch.topk on s + b: the same ids (random scores have no ties)
    and bit-identical cutoffs; a row of equal values takes the lowest ids; NaN scores rank first (as in
    torch.topk), so no id is out of range."""
    from k3.ops.router import topk_with_cutoff_triton

    g = torch.Generator().manual_seed(N + E + k)
    scores = torch.rand(N, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.1
    scores[1] = 0.5  # all equal (with a zero bias below): ids 0..k-1
    scores[2, [3, E - 1]] = float("nan")
    b = bias.clone()
    idx, cutoff = topk_with_cutoff_triton(scores, b * 0 if N == 3 else b, k)
    used = b * 0 if N == 3 else b
    vals, ref = torch.topk(scores + used, k + 1, dim=-1)
    tag = f"topk+cutoff N={N} E={E} k={k}"
    plain = [r for r in range(N) if r not in (1, 2)]
    ok = (torch.equal(idx[plain], ref[plain, :k]) and torch.equal(cutoff[plain], vals[plain, k])
          and int(idx.min()) >= 0 and int(idx.max()) < E
          and torch.equal(idx[2, :2], torch.tensor([3, E - 1])[:k]))
    if N == 3:
        ok = ok and torch.equal(idx[1], torch.arange(k)) and cutoff[1].item() == 0.5
    assert ok, tag


@pytest.mark.parametrize("N, E, num_bins", [(70, 64, 1000), (9, 100, 37)])
def test_qb_histogram(N, E, num_bins):
    """Quantile Balancing's histogram from the fused kernel against the torch path: identical counts over two
    micro-batches, with values binned below the range, above it (clamped) and exactly on bin edges."""
    from k3.model.quantile_balancing import QuantileHistogram, route_topk_with_cutoff

    g = torch.Generator().manual_seed(N * E)
    bias = torch.randn(E, generator=g) * 0.02
    hists = [QuantileHistogram(bias, num_bins, fused=fused) for fused in (False, True)]
    for step in range(2):
        scores = torch.sigmoid(torch.randn(N, E, generator=g) * 2)
        _, cutoff = route_topk_with_cutoff(scores, bias, 4)
        if step:  # outside [lo, hi] (clamped into the end bins), and on the edges themselves
            cutoff = cutoff.clone()
            cutoff[0], cutoff[1] = 50.0, -50.0
            scores[2] = cutoff[2] - (hists[0].lo + hists[0]._width * torch.arange(E) % num_bins)
        for hist in hists:
            hist.add(scores, cutoff)
    tag = f"qb histogram N={N} E={E} bins={num_bins}"
    ok = torch.equal(hists[0].counts, hists[1].counts) and int(hists[1].counts.sum()) == 2 * N * E
    assert ok, tag


def test_model_two_phase():
    """The debug model (5 layers in blocks of 2, random queries) in fp64 with the fused two-phase wiring (fp32
    inside the AttnRes kernels) against the direct wiring: logits ≤ 2e-6, every parameter gradient ≤ 5e-5 (the
    model's other ops in fp64, so only the kernels' fp32 rounding separates the two, amplified through five
    layers' backward: 9e-6 at most when written; a wrong or missing term shows as 1e-2 or more)."""
    from k3.config import get_preset
    from k3.model import attn_res as attn_res_model
    from k3.model import model as model_module
    from k3.model.model import build_model
    from k3.ops.attn_res import two_phase_fits

    config = get_preset("debug").replace(vision_config=None)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    available, phase1 = model_module.fused_two_phase_available, attn_res_model.attn_res_phase1_triton
    fused_calls = []
    runs = {}
    try:
        # the fused two-phase path on CPU tensors, through the interpreter; its phase-1 calls counted
        model_module.fused_two_phase_available = lambda x, J: two_phase_fits(J, x.shape[-1])
        attn_res_model.attn_res_phase1_triton = lambda *a, **k: fused_calls.append(1) or phase1(*a, **k)
        for impl in ("direct", "two_phase"):
            model = build_model(config.replace(attn_res_impl=impl), seed=3, dtype=torch.float64)
            runs[impl] = debug_model_gradients(model, ids)
    finally:
        model_module.fused_two_phase_available, attn_res_model.attn_res_phase1_triton = available, phase1
    # one phase 1 per block: 5 layers in blocks of 2
    assert len(fused_calls) == 3, f"model two-phase: {len(fused_calls)} fused phase-1 calls, expected 3"
    for key, ref in runs["direct"].items():
        if ref.abs().sum() > 0:
            check(f"model two-phase {key}", runs["two_phase"][key], ref, torch.float32,
                  None if key == "logits" else 5e-5)


# the backward's tiles: documents ending exactly at a token-tile edge (64), one token before one (127: dx of
# tokens 125-126 must not take g from the next tile, which is the next document) and one after (129: token
# 127 takes g from the next tile), T and C not multiples of the tile; batched rows ending at tile edges
BT, BC = short_conv._CONV_BWD_BT, short_conv._CONV_BWD_BC
AT_TILE_EDGES = [BT, BT - 1, 2, BT + 1, 1, 4]


# g_fp32 False: g between the backward's kernels in x's dtype (fp32 input keeps fp32)
@pytest.mark.parametrize("dtype, B, T, C, lengths, tol_dtype, g_fp32", [
    # documents of 1, 2 and 3 tokens (shorter than the 3-token history), one crossing the 64-token blocks
    (F32, 1, 140, 70, [1, 2, 3, 60, 1, 73], None, True),
    (BF16, 1, 140, 70, [1, 2, 3, 60, 1, 73], None, True),
    (F32, 2, 67, 64, None, None, True),
    (F32, 1, 1, 5, [1], None, True),
    (F32, 1, 3 * BT + 7, BC + 3, AT_TILE_EDGES, None, True),
    (F32, 3, BT, BC - 24, None, None, True),
    (F16, 1, 3 * BT + 7, BC + 3, AT_TILE_EDGES, BF16, True),
    (F32, 1, 3 * BT + 7, BC + 3, AT_TILE_EDGES, None, False),
    (BF16, 1, 3 * BT + 7, BC + 3, AT_TILE_EDGES, None, False)])
def test_conv_silu(dtype, B, T, C, lengths, tol_dtype, g_fp32, monkeypatch):
    """The fused short conv + SiLU against the fp64 reference, forward and both gradients; `tol_dtype` holds
    a dtype without a tolerance of its own (fp16) to another's."""
    monkeypatch.setattr(short_conv, "_CONV_G_FP32", g_fp32)
    g = torch.Generator().manual_seed(T + C)
    cu = None if lengths is None else torch.tensor([0] + lengths).cumsum(0)
    # a column slice of a wider projection output, as the KDA layer passes it
    wide = torch.randn(B, T, 3 * C, generator=g, dtype=torch.float64) * 2
    w = torch.randn(C, 1, 4, generator=g, dtype=torch.float64) * 0.7
    xr, wr = leaf(wide[..., C:2 * C]), leaf(w)
    ref = naive_short_conv_silu(xr, wr, cu)
    dy = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(dy)
    wide_t, wt = leaf(wide, dtype), leaf(w, torch.float32)
    out = short_conv_silu(wide_t[..., C:2 * C], wt, cu)
    out.backward(dy.to(dtype))
    tag = f"conv+silu B={B} T={T} C={C} docs={lengths}" + (f" {dtype}" if tol_dtype else "")
    check(tag + " forward", out, ref, tol_dtype or dtype)
    check(tag + " dx", wide_t.grad[..., C:2 * C], xr.grad, tol_dtype or dtype)
    check(tag + " dw", wt.grad, wr.grad, tol_dtype or dtype)
    assert wide_t.grad[..., :C].abs().max() == 0 and wide_t.grad[..., 2 * C:].abs().max() == 0


# the second case: two vocabulary tiles, the second partial
@pytest.mark.parametrize("dtype, N, V, chunk_rows", [(F32, 21, 300, 8), (F32, 9, 5000, 4), (BF16, 21, 300, 8)])
def test_loss_rows(dtype, N, V, chunk_rows):
    """The chunked loss with its per-row Triton kernel (logsumexp, loss, softmax − onehot in place)."""
    g = torch.Generator().manual_seed(V)
    h = torch.randn(N, 24, generator=g, dtype=torch.float64) * 2
    w = torch.randn(V, 24, generator=g, dtype=torch.float64) * 0.5
    y = torch.randint(0, V, (N,), generator=g)
    y[[1, N - 2]] = -100
    hr, wr = leaf(h), leaf(w)
    ref = naive_linear_cross_entropy(hr, wr, y)
    ref.backward()
    ht, wt = leaf(h, torch.float32), leaf(w, torch.float32)
    calls = []
    kernel = cross_entropy._loss_and_logit_grad_triton
    cross_entropy._loss_and_logit_grad_triton = lambda *a: calls.append(1) or kernel(*a)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = chunked_linear_cross_entropy(ht, wt, y, chunk_rows=chunk_rows, rows_kernel=True)
    cross_entropy._loss_and_logit_grad_triton = kernel
    loss.backward()
    assert len(calls) == -(-N // chunk_rows), "the row kernel was not the path taken"
    tag = f"chunked loss N={N} V={V} chunk={chunk_rows}"
    check(tag + " loss", loss.reshape(1), ref.reshape(1), dtype)
    check(tag + " dh", ht.grad, hr.grad, dtype)
    check(tag + " dw", wt.grad, wr.grad, dtype)
    assert ht.grad[1].abs().max() == 0 and ht.grad[N - 2].abs().max() == 0

