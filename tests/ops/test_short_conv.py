"""Causal depthwise short conv of the KDA q/k/v paths: against torch's conv1d, split with a
carried state, and packed documents (cu_seqlens); the fused short conv + SiLU's backward variants on a GPU or
in the Triton interpreter (a subprocess on CPU).

Legend: B batch, T tokens, C channels, W kernel width.
"""

import pytest
import torch
import torch.nn.functional as F

from k3.ops import short_conv
from k3.ops.short_conv import causal_conv1d, naive_causal_conv1d
from tests.interpreter import INTERPRETING, ON_GPU, cases, kernel_device, rerun_in_interpreter

IMPLS = pytest.mark.parametrize("conv", [naive_causal_conv1d, causal_conv1d], ids=["naive", "fast"])


def assert_same_outputs(conv, got, ref):
    """Outputs of one function on the same taps: bit for bit from the reference, which sums in a fixed order; the
    fast form's `F.conv1d` may pick another CPU kernel for another length (seen with torch 2.13 on one 2-core
    Xeon: length-1 calls differ from a long call in the last bit), so ≤ 1e-14 in fp64 there."""
    if conv is naive_causal_conv1d:
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, atol=1e-14, rtol=0)


def _inputs(B: int, T: int, C: int, W: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g, dtype=dtype)
    weight = torch.randn(C, 1, W, generator=g, dtype=dtype)
    return x, weight


def torch_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise conv1d with W-1 zeros of left padding: y_t = Σ_j w[j] · x_{t-W+1+j}."""
    C, _, W = weight.shape
    xt = F.pad(x.transpose(1, 2), (W - 1, 0))  # [B, C, W-1+T]
    return F.conv1d(xt, weight, groups=C).transpose(1, 2)  # [B, T, C]


@pytest.mark.parametrize("T", [1, 2, 3, 4, 7, 33])
@pytest.mark.parametrize("W", [1, 2, 4])
@IMPLS
def test_matches_torch_conv1d(T, W, conv):
    x, weight = _inputs(2, T, 5, W, seed=T * 10 + W)
    ref = torch_conv(x, weight)
    tri, state = conv(x, weight)
    # fp64, same products in a different order: ≤ 1e-12
    torch.testing.assert_close(tri, ref, atol=1e-12, rtol=0)
    assert state.shape == (2, W - 1, 5)
    # the state is the last W-1 inputs, with zero history in front when T < W-1
    padded = torch.cat([x.new_zeros(2, W - 1, 5), x], dim=1)
    assert torch.equal(state, padded[:, padded.shape[1] - (W - 1):])


@IMPLS
def test_weight_2d_and_fp32_dtype(conv):
    x, weight = _inputs(1, 9, 4, 4, seed=1, dtype=torch.float32)
    a, _ = conv(x, weight)
    b, _ = conv(x, weight.view(4, 4))
    assert torch.equal(a, b)
    assert a.dtype == torch.float32
    # fp32 compute against torch's fp32 conv: ≤ 1e-5
    torch.testing.assert_close(a, torch_conv(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T1", [0, 1, 2, 3, 5, 11])
@IMPLS
def test_split_with_state_equals_one_pass(T1, conv):
    T, W = 11, 4
    x, weight = _inputs(2, T, 6, W, seed=100 + T1)
    full, full_state = conv(x, weight)
    y1, s1 = conv(x[:, :T1], weight)
    y2, s2 = conv(x[:, T1:], weight, conv_state=s1)
    # same products in the same order: bit-identical (the reference; the fast form within 1e-14)
    assert_same_outputs(conv, torch.cat([y1, y2], dim=1), full)
    assert torch.equal(s2, full_state)


@IMPLS
def test_token_by_token_equals_one_pass(conv):
    T, W = 9, 4
    x, weight = _inputs(1, T, 3, W, seed=7)
    full, full_state = conv(x, weight)
    state, outs = None, []
    for t in range(T):
        y, state = conv(x[:, t : t + 1], weight, conv_state=state)
        outs.append(y)
    assert_same_outputs(conv, torch.cat(outs, dim=1), full)
    assert torch.equal(state, full_state)


@IMPLS
def test_bad_state_shape_raises(conv):
    x, weight = _inputs(1, 5, 3, 4, seed=0)
    with pytest.raises(ValueError):
        conv(x, weight, conv_state=torch.zeros(1, 2, 3, dtype=x.dtype))


@pytest.mark.parametrize("lengths", [[5, 7], [1, 2, 9, 1], [3, 3, 3], [12]])
@IMPLS
def test_varlen_equals_separate_runs(lengths, conv):
    W, C = 4, 5
    total = sum(lengths)
    x, weight = _inputs(1, total, C, W, seed=sum(lengths) + len(lengths))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    packed, _ = conv(x, weight, cu_seqlens=cu)
    separate = torch.cat([conv(x[:, s:e], weight)[0] for s, e in zip(cu[:-1], cu[1:])], dim=1)
    # fp64; same taps, products masked instead of skipped: ≤ 1e-14
    torch.testing.assert_close(packed, separate, atol=1e-14, rtol=0)


@IMPLS
def test_varlen_no_leakage_across_document_start(conv):
    W, C = 4, 3
    cu = torch.tensor([0, 6, 8, 15])
    x, weight = _inputs(1, 15, C, W, seed=3)
    base, _ = conv(x, weight, cu_seqlens=cu)
    # a large finite change to document 1 (positions 6, 7) moves document 1 only, bit for bit
    x2 = x.clone()
    x2[:, 6:8] += 1e6
    moved, _ = conv(x2, weight, cu_seqlens=cu)
    assert torch.equal(moved[:, :6], base[:, :6])
    assert torch.equal(moved[:, 8:], base[:, 8:])
    assert not torch.equal(moved[:, 6:8], base[:, 6:8])
    # changing the last tokens of document 0 (what document 1's first taps would reach) moves document 0 only
    x3 = x.clone()
    x3[:, 3:6] -= 3.0
    moved, _ = conv(x3, weight, cu_seqlens=cu)
    assert torch.equal(moved[:, 6:], base[:, 6:])


@IMPLS
def test_varlen_nan_stays_in_its_document(conv):
    W, C = 4, 3
    cu = torch.tensor([0, 6, 8, 15])
    x, weight = _inputs(1, 15, C, W, seed=3)
    base, _ = conv(x, weight, cu_seqlens=cu)
    # NaN-poison the tail of document 0 and all of document 1
    x2 = x.clone()
    x2[:, 3:8] = float("nan")
    poisoned, _ = conv(x2, weight, cu_seqlens=cu)
    assert torch.equal(poisoned[:, :3], base[:, :3])
    assert torch.equal(poisoned[:, 8:], base[:, 8:])


@IMPLS
def test_varlen_with_per_document_history_equals_separate_calls(conv):
    """Each packed document continues from its own history (the engine's ragged decode/prefill)."""
    W, C = 4, 5
    lengths = [6, 1, 0, 2, 9]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    x, weight = _inputs(1, sum(lengths), C, W, seed=7)
    states = torch.randn(len(lengths), W - 1, C, dtype=x.dtype, generator=torch.Generator().manual_seed(8))
    y, new_states = conv(x, weight, states, cu_seqlens=cu)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref_y, ref_state = conv(x[:, a:b], weight, states[n : n + 1])
        assert_same_outputs(conv, y[:, a:b], ref_y)
        assert torch.equal(new_states[n], ref_state[0])


@pytest.mark.parametrize("history", [False, True])
@pytest.mark.parametrize("lengths", [[23], [5, 0, 1, 14, 3], [1, 1, 1, 20]])
def test_fast_matches_reference_with_gradients(lengths, history):
    """causal_conv1d against naive_causal_conv1d in fp64: outputs, new states and all gradients ≤ 1e-12."""
    W, C = 4, 6
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    x, weight = _inputs(1, sum(lengths), C, W, seed=11)
    states = torch.randn(len(lengths), W - 1, C, dtype=x.dtype, generator=torch.Generator().manual_seed(12))
    leaves = [x, weight] + ([states] if history else [])
    results = []
    for conv in (naive_causal_conv1d, causal_conv1d):
        inputs = [t.clone().requires_grad_() for t in leaves]
        y, s = conv(inputs[0], inputs[1], inputs[2] if history else None, cu_seqlens=cu)
        g = torch.Generator().manual_seed(13)
        loss = ((y * torch.randn(y.shape, generator=g, dtype=y.dtype)).sum()
                + (s * torch.randn(s.shape, generator=g, dtype=s.dtype)).sum())
        results.append([y, s, *torch.autograd.grad(loss, inputs)])
    for ref, fast in zip(*results):
        torch.testing.assert_close(fast, ref, rtol=0, atol=1e-12)


def test_fast_bf16_error_within_reference_error():
    """bf16 activations, fp32 weights: the fast path is no further from fp64 than the reference (relative
    RMSE of the output, new states and gradients; its fp32 accumulation of the taps is at least as good)."""
    W, C, lengths = 4, 64, [5, 0, 1, 200, 30]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    x, weight = _inputs(1, sum(lengths), C, W, seed=21)
    states = torch.randn(len(lengths), W - 1, C, dtype=x.dtype, generator=torch.Generator().manual_seed(22))
    probe = torch.linspace(-1, 1, x.numel(), dtype=torch.float64).view_as(x)

    def run(conv, dtype):
        xs, st = x.to(dtype).requires_grad_(), states.to(dtype).requires_grad_()
        w = weight.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
        y, s = conv(xs, w, st, cu_seqlens=cu)
        grads = torch.autograd.grad((y.double() * probe).sum() + s.double().sum(), [xs, w, st])
        return [t.double() for t in (y, s, *grads)]

    exact = run(naive_causal_conv1d, torch.float64)
    for ref, fast, truth in zip(run(naive_causal_conv1d, torch.bfloat16), run(causal_conv1d, torch.bfloat16), exact):
        err = lambda t: float((t - truth).norm() / truth.norm())  # noqa: E731
        assert err(fast) <= err(ref) * 1.01 + 1e-7, (err(fast), err(ref))
        assert err(fast) < 5e-3


def test_fast_is_a_few_ops():
    """The point of the fast path: a packed call is ≲ 30 tensor ops forward and ≲ 15 backward (the
    reference: ~80 and ~40), each a kernel launch on a GPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    free = {"aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::t", "aten::transpose", "aten::expand",
            "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::reshape", "aten::alias",
            "aten::detach", "aten::empty", "aten::empty_like", "aten::new_empty", "aten::empty_strided",
            "aten::new_empty_strided", "aten::lift_fresh", "aten::is_same_size"}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func._schema.name not in free
            return func(*args, **(kwargs or {}))

    x = torch.randn(1, 300, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(64, 1, 4, requires_grad=True)
    cu = torch.tensor([0, 100, 130, 300], dtype=torch.int32)
    counts = {}
    for conv in (naive_causal_conv1d, causal_conv1d):
        with Count() as forward:
            y, _ = conv(x, weight, None, cu_seqlens=cu)
        with Count() as backward:
            y.float().sum().backward()
        counts[conv.__name__] = (forward.n, backward.n)
    assert counts["causal_conv1d"][0] <= 30 and counts["causal_conv1d"][1] <= 15, counts
    assert counts["naive_causal_conv1d"][0] >= 2 * counts["causal_conv1d"][0], counts


def test_fast_column_cache_follows_identity_and_version():
    """The stream columns are reused for the same cu_seqlens tensor, recomputed after an in-place change,
    and never cached for inference tensors (they have no version counter)."""
    x, weight = _inputs(1, 10, 3, 4, seed=31)
    cu = torch.tensor([0, 4, 10])
    first, _ = causal_conv1d(x, weight, cu_seqlens=cu)
    cu[1] = 7  # same object, new contents
    moved, _ = causal_conv1d(x, weight, cu_seqlens=cu)
    torch.testing.assert_close(moved, naive_causal_conv1d(x, weight, cu_seqlens=cu)[0], rtol=0, atol=1e-12)
    assert not torch.equal(first, moved)
    with torch.inference_mode():
        cu_inf = torch.tensor([0, 2, 10])
        y, _ = causal_conv1d(x, weight, cu_seqlens=cu_inf)
        torch.testing.assert_close(y, naive_causal_conv1d(x, weight, cu_seqlens=cu_inf)[0], rtol=0, atol=1e-12)


def test_fast_stays_fp32_under_autocast():
    """Training runs under bf16 autocast, which would run F.conv1d (and round the fp32 conv weights) in
    bf16: the fast path opts out, so under autocast it still agrees with the reference's fp32 arithmetic
    (bf16 would put them ~1e-3 apart)."""
    cu = torch.tensor([0, 100, 300])
    x, weight = _inputs(1, 300, 64, 4, seed=41)
    probe = torch.linspace(-1, 1, x.numel(), dtype=torch.float64).view_as(x)
    results = []
    for conv in (naive_causal_conv1d, causal_conv1d):
        w = weight.float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = conv(x.to(torch.bfloat16), w, cu_seqlens=cu)
        assert y.dtype == torch.bfloat16
        (grad,) = torch.autograd.grad((y.double() * probe).sum(), [w])
        results.append(grad.double())
    naive, fast = results
    assert float((fast - naive).norm() / naive.norm()) < 1e-5


def test_fast_column_cache_not_filled_under_inference_mode():
    """Columns computed under inference mode are inference tensors: a later training call with the same
    cu_seqlens must not get them (they cannot be saved for backward)."""
    x, weight = _inputs(1, 10, 3, 4, seed=51)
    cu = torch.tensor([0, 3, 10])
    with torch.inference_mode():
        causal_conv1d(x, weight, cu_seqlens=cu)
    xg = x.clone().requires_grad_()
    y, _ = causal_conv1d(xg, weight, cu_seqlens=cu)
    y.sum().backward()
    assert xg.grad is not None


def test_short_conv_silu_reference_and_checks():
    """The fused kernel's reference is SiLU of the convolution from zero history; its entry checks run on CPU
    (the kernel itself: tests/ops/triton_interpreter_checks.py and tests/gpu)."""
    from k3.ops.short_conv import naive_short_conv_silu, short_conv_silu, short_conv_silu_available

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 30, 6, generator=g, dtype=torch.float64)
    w = torch.randn(6, 1, 4, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 2, 9, 30])
    expected = torch.nn.functional.silu(naive_causal_conv1d(x, w, cu_seqlens=cu)[0])
    assert torch.allclose(naive_short_conv_silu(x, w, cu), expected, rtol=1e-14, atol=0)
    assert not short_conv_silu_available(x)  # fp64 never takes the kernel
    with pytest.raises(ValueError, match=r"\[B, T, C\]"):
        short_conv_silu(x[0], w)
    with pytest.raises(ValueError, match="weight"):
        short_conv_silu(x.float(), w[:5].float())
    with pytest.raises(ValueError, match="batch of 1"):
        short_conv_silu(x.float().expand(2, -1, -1), w.float(), cu)
    if not INTERPRETING:
        with pytest.raises(RuntimeError, match="Triton"):
            short_conv_silu(x.float(), w.float())


test_fused_backward_variants_in_interpreter = rerun_in_interpreter(f"{__file__}::test_fused_backward_variants")


@pytest.fixture
def dev():
    return kernel_device()


class _Launches:
    """A Triton kernel whose launches are counted."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


GRAD_BLOCKS = {"per-block": None, "blocks3": (8, 32, 4, 3, 1), "blocks2-staged": (16, 32, 4, 2, 2),
               "gpu-default": short_conv._CONV_GRAD_BLOCKS,
               "interpreter-default": short_conv._CONV_GRAD_BLOCKS_INTERPRETED}


# W = 3 (the other side of the kernels' `W > 3`) does not meet the block settings' loops: in the interpreter it runs
# with the per-block kernel and the multi-block one at the interpreter's default
@pytest.mark.parametrize("setting,W", cases(*((name, W) for W in (4, 3) for name in GRAD_BLOCKS),
                                            gpu_only=(("blocks3", 3), ("blocks2-staged", 3), ("gpu-default", 3))))
def test_fused_backward_variants(setting, W, dev, monkeypatch):
    """short_conv_silu with kernel 1 as the per-block kernel and as the multi-block one at several settings and at
    both defaults (`_CONV_GRAD_BLOCKS`, `_CONV_GRAD_BLOCKS_INTERPRETED`), fp32 against the fp64 reference: output,
    dx and dw ≤ 1e-5 relative RMSE. Packed documents that end at, one before and one after the 24-token program
    blocks and at 127-129 (the 32- and 128-token blocks), three 128-row programs, tokens and channels not
    multiples of the tiles; and batched rows without documents."""
    blocks = GRAD_BLOCKS[setting]
    if ON_GPU and setting == "interpreter-default":
        pytest.skip("the interpreter's 128-row tiles: a slow, spilling compile on a GPU")
    monkeypatch.setattr(short_conv, "_CONV_GRAD_BLOCKS", blocks)
    monkeypatch.setattr(short_conv, "_CONV_GRAD_BLOCKS_INTERPRETED", blocks)
    monkeypatch.setattr(short_conv, "_CONV_FWD_STREAM", None)
    monkeypatch.setattr(short_conv, "_CONV_BWD_STREAM", None)
    monkeypatch.setattr(short_conv, "_CONV_STREAM_INTERPRETED", None)
    launches = _Launches(short_conv._conv_silu_grad_blocks_kernel)
    monkeypatch.setattr(short_conv, "_conv_silu_grad_blocks_kernel", launches)
    _check_fused_against_reference(W, dev)
    assert launches.count == (0 if blocks is None else 3)


test_fused_stream_variants_in_interpreter = rerun_in_interpreter(f"{__file__}::test_fused_stream_variants")


@pytest.mark.parametrize("stream, W", [((24, 32, 1, 1), 4), ((24, 32, 1, 1), 3), ((128, 64, 2, 3), 4)],
                         ids=["seg24", "seg24-W3", "seg128-staged"])
def test_fused_stream_variants(stream, W, dev, monkeypatch):
    """The streaming forward and backward (`_CONV_FWD_STREAM`, `_CONV_BWD_STREAM`: the GPU's default; in the
    interpreter `_CONV_STREAM_INTERPRETED`) at several segment and channel
    widths, fp32 against the fp64 reference (≤ 1e-5): documents ending at, one before and one after the 24-token
    segments and 127-129 (the 128-token ones), so a segment's three halo rows cross into the next document;
    channels not a multiple of BC (37 against 32 and 64); batched rows without documents."""
    monkeypatch.setattr(short_conv, "_CONV_FWD_STREAM", stream)
    monkeypatch.setattr(short_conv, "_CONV_BWD_STREAM", stream)
    monkeypatch.setattr(short_conv, "_CONV_STREAM_INTERPRETED", stream)
    launches = [_Launches(short_conv._conv_silu_fwd_stream_kernel), _Launches(short_conv._conv_silu_bwd_stream_kernel)]
    monkeypatch.setattr(short_conv, "_conv_silu_fwd_stream_kernel", launches[0])
    monkeypatch.setattr(short_conv, "_conv_silu_bwd_stream_kernel", launches[1])
    _check_fused_against_reference(W, dev)
    assert [n.count for n in launches] == [3, 3]


def _check_fused_against_reference(W, device):
    from k3.ops.short_conv import naive_short_conv_silu, short_conv_silu

    g = torch.Generator().manual_seed(W)
    C = 37
    # the third input spans three 128-row programs (the defaults' blocks), documents ending at 127, 128 and 129
    for B, lengths in ((1, [24, 23, 2, 25, 1, 8, 33]), (2, None), (1, [127, 1, 1, 130, 40])):
        T = sum(lengths) if lengths else 45
        cu = None if lengths is None else torch.tensor([0] + lengths).cumsum(0).to(device)
        # x a column slice of a wider projection output, as the KDA layer passes it
        wide = torch.randn(B, T, 3 * C, generator=g, dtype=torch.float64).to(device) * 2
        w = (torch.randn(C, 1, W, generator=g, dtype=torch.float64) * 0.7).to(device)
        dy = torch.randn(B, T, C, generator=g, dtype=torch.float64).to(device)
        xr, wr = wide[..., C:2 * C].clone().requires_grad_(), w.clone().requires_grad_()
        ref = naive_short_conv_silu(xr, wr, cu)
        ref.backward(dy)
        xt, wt = wide.float().requires_grad_(), w.float().requires_grad_()
        tri = short_conv_silu(xt[..., C:2 * C], wt, cu)
        tri.backward(dy.float())
        for name, got, want in (("y", tri, ref), ("dx", xt.grad[..., C:2 * C], xr.grad), ("dw", wt.grad, wr.grad)):
            err = float((got.double() - want).norm() / want.norm())
            assert err <= 1e-5, (name, B, err)


def test_stream_backward_carries_its_row_windows():
    """The streaming backward's loop carries all ten of its row vectors (x, g at u − 1..u − 3 and the four dw
    sums), compiled for sm_90 offline. Triton carries a name through a loop only if its value changes there; the
    first form started g1, g2, g3 from one zeros tensor, so `g3 = g2` looked unchanged and g2, g3 stayed zero on
    the GPU while the interpreter (plain Python) was right."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(X="*bf16", Wt="*fp32", POS="*i32", DY="*bf16", DX="*bf16", DW="*fp32", R="i32", C="i32",
                     stride_x="i32", stride_dy="i32")
    try:
        kernel = triton.compile(ASTSource(short_conv._conv_silu_bwd_stream_kernel, signature,
                                          dict(W=4, SEG=128, BC=512, STAGES=1), {}),
                                target=GPUTarget("cuda", 90, 64), options=dict(num_warps=2, num_stages=1))
    except Exception as e:  # no CUDA backend in this Triton build
        pytest.skip(f"offline sm_90 compile unavailable: {type(e).__name__}")
    loops = [line for line in kernel.asm["ttir"].splitlines() if "scf.for" in line]
    assert len(loops) == 1
    carried = loops[0].split("iter_args(")[1].split(")")[0].count("=")
    assert carried == 10, loops[0][:300]
