"""QAT fake quantization (k3.ops.qat): bit-exact against torchao's MXTensor, the straight-through gradient, and the
three routed-expert paths (reference, grouped, gathered) agreeing under QAT, in values and every gradient.

Legend: N tokens, k experts per token, E experts, L latent width, I expert hidden width.
"""

import logging

import pytest
import torch

from k3.model.moe import LatentExperts
from k3.ops.mx import SCALE_MODES, e8m0_scale, mx_dequantize, mx_fake_quantize, mx_quantize
from k3.ops.qat import (fake_quantize_input, fake_quantize_ste, fake_quantize_weight,
                        qat_gathered_latent_experts, qat_grouped_latent_experts)
from k3.ops.situ import naive_situ_glu

NAN = float("nan")
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints of the E2M1 grid; RNE: 0, 1, 1, 2, 2, 4, 4
# E4M3 midpoints -> RNE: 1 + 1/16 -> 1, 1 + 3/16 -> 1.25, 2^-10 -> 0 and 1.5·2^-9 -> 2^-8 (subnormals), 200 -> 192,
# 2^-6 + 2^-10 -> 2^-6 (smallest normal binade)
E4M3_TIES = (1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 200.0, 2.0 ** -6 * 1.0625)
TIES_ROUNDED = {"e2m1": [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0], "e4m3": [1.0, 1.25, 0.0, 2.0 ** -8, 192.0, 2.0 ** -6]}


def special_blocks(elem: str, mode: str) -> torch.Tensor:
    """[., 32] blocks: zeros, fp32 and bf16 subnormal elements, exact powers of two, ±max of the element format at
    several scales and of fp32/bf16, NaN, the element grid's round-to-nearest-even ties (at the scale `mode` gives
    the block), and random magnitudes. Every block whose scale code is 0 is all zeros (torchao rounds differently
    there by design: k3.ops.mx docstring)."""
    emax_value = 6.0 if elem == "e2m1" else 448.0
    g = torch.Generator().manual_seed(7)
    # a block whose largest element is emax_value gets the scale X under `mode`: the ties sit at ±t·X beside it
    X = 2.0 ** (int(e8m0_scale(torch.tensor(emax_value), elem, mode)) - 127)
    ties = E2M1_TIES if elem == "e2m1" else E4M3_TIES
    tie_block = torch.tensor([emax_value] + [t * X * s for t in ties for s in (1, -1)])
    blocks = [
        torch.zeros(32), -torch.zeros(32),
        torch.cat([torch.tensor([1.0, 1e-40, -3e-41, 2.0 ** -133, 2.0 ** -149, 9.2e-41]), torch.zeros(26)]),
        torch.tensor([2.0 ** k for k in range(-20, 12)]), torch.tensor([-(2.0 ** k) for k in range(90, 122)]),
        torch.tensor([emax_value, -emax_value] * 16), torch.tensor([emax_value * 2.0 ** k for k in range(-16, 16)]),
        torch.full((32,), 3.4028234663852886e38), torch.full((32,), -3.3895313892515355e38),  # fp32, bf16 max
        torch.cat([torch.tensor([NAN]), torch.ones(31)]), torch.cat([torch.ones(31), torch.tensor([NAN])]),
        torch.cat([tie_block, torch.zeros(32 - len(tie_block))]),
        torch.full((32,), 0.1),
    ]
    rand = torch.randn(23, 32, generator=g) * torch.exp2(torch.randint(-40, 40, (23, 1), generator=g).float())
    return torch.cat([torch.stack(blocks), rand])


@pytest.fixture(scope="module")
def torchao_mx():
    logging.disable(logging.WARNING)  # torchao logs about its CUDA-only extensions
    try:
        mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
    finally:
        logging.disable(logging.NOTSET)
    return mx.MXTensor, ScaleCalculationMode


@pytest.mark.parametrize("mode", SCALE_MODES)
@pytest.mark.parametrize("elem", ["e2m1", "e4m3"])
def test_fake_quantize_bit_exact_against_torchao_mxtensor(torchao_mx, elem, mode):
    MXTensor, Mode = torchao_mx
    ao_elem = {"e2m1": torch.float4_e2m1fn_x2, "e4m3": torch.float8_e4m3fn}[elem]
    x = special_blocks(elem, mode).reshape(-1, 64)  # two blocks per row
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        ref = MXTensor.to_mx(xd, ao_elem, 32, getattr(Mode, mode.upper())).dequantize(dtype)
        got = fake_quantize_ste(xd, elem, mode)
        assert got.dtype == dtype
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.isnan(), ref.isnan())
        assert torch.equal(got.nan_to_num(0.0).view(bits), ref.nan_to_num(0.0).view(bits)), (elem, mode, dtype)
    # the ties round to even (hand-computed, no oracle): block 11 holds the format's max, then ±t·X for each tie t
    X = 2.0 ** (int(e8m0_scale(torch.tensor(6.0 if elem == "e2m1" else 448.0), elem, mode)) - 127)
    want = TIES_ROUNDED[elem]
    rounded = fake_quantize_ste(special_blocks(elem, mode)[11], elem, mode)[1:1 + 2 * len(want)] / X
    assert rounded[0::2].tolist() == want and (-rounded[1::2]).tolist() == want
    # a NaN anywhere makes its whole block NaN, and only that block
    nan_rows = fake_quantize_ste(special_blocks(elem, mode)[9:11].reshape(1, 64), elem, mode)
    assert nan_rows.isnan().all()


@pytest.mark.parametrize("mode", SCALE_MODES)
@pytest.mark.parametrize("elem", ["e2m1", "e4m3"])
def test_fake_quantize_equals_quantize_then_dequantize(elem, mode):
    """The fake quantization (no packing) and the converter's pack → unpack path decode to the same bits."""
    x = special_blocks(elem, mode).reshape(-1, 64)
    for dtype in (torch.float32, torch.bfloat16):
        fake = mx_fake_quantize(x.to(dtype), elem, 32, mode)
        packed = mx_dequantize(*mx_quantize(x.to(dtype), elem, 32, mode), elem, 32, dtype)
        assert torch.equal(fake.isnan(), packed.isnan())
        assert torch.equal(fake.nan_to_num(0.0), packed.nan_to_num(0.0))
        assert torch.equal(fake.nan_to_num(0.0).signbit(), packed.nan_to_num(0.0).signbit())


def test_straight_through_gradient_is_the_identity():
    x = torch.randn(3, 64, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 64, dtype=torch.float64)
    for elem in ("e2m1", "e4m3"):
        (grad,) = torch.autograd.grad(fake_quantize_ste(x, elem, "rceil"), x, g)
        assert torch.equal(grad, g)
    assert fake_quantize_weight(x, None) is x and fake_quantize_input(x, None) is x  # QAT off: untouched


@pytest.mark.parametrize("mode", SCALE_MODES)
@pytest.mark.parametrize("elem", ["e2m1", "e4m3"])
def test_dequantized_values_are_fixed_points(elem, mode):
    """fq(fq(x)) == fq(x): a model loaded from its MXFP4 export re-quantizes to the same values under QAT."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.02
    once = mx_fake_quantize(x, elem, 32, mode)
    assert torch.equal(mx_fake_quantize(once, elem, 32, mode), once)
    assert torch.equal(mx_fake_quantize(once.bfloat16(), elem, 32, mode), once.bfloat16())  # exact in bf16


# ---- the three expert paths ------------------------------------------------------------------------------------

def make_experts(E, L, I, mode, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    experts = LatentExperts(E, L, I, 4.0, 25.0, impl="reference", qat_scale_mode=mode)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.3)
    return experts.to(dtype)


def routes(N, k, E, seed):
    """Distinct experts per token; expert E-1 unused (a zero-gradient expert)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(N)])


def expert_inputs(N, k, E, L, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, L, generator=g, dtype=dtype).requires_grad_()
    w = torch.rand(N, k, generator=g, dtype=dtype).requires_grad_()
    return z, routes(N, k, E, seed), w


def per_pair_oracle(z, idx, w, w1q, w3q, w2q, mode):
    """Σ_j w_j · y_j one (token, expert) pair at a time, plain autograd on given dequantized weights; the activation's
    quantization by the detach form of the straight-through rule, a + (fq8(a) − a).detach()."""
    N, k = idx.shape
    zq = z + (mx_fake_quantize(z.detach(), "e4m3", 32, mode) - z.detach())
    rows = []
    for n in range(N):
        acc = 0
        for j in range(k):
            e = int(idx[n, j])
            a = naive_situ_glu(zq[n] @ w1q[e].t(), zq[n] @ w3q[e].t(), 4.0, 25.0)
            aq = a + (mx_fake_quantize(a.detach()[None], "e4m3", 32, mode)[0] - a.detach())
            acc = acc + w[n, j] * (aq @ w2q[e].t())
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_ste_gradient_equals_the_gradient_at_the_dequantized_operands(mode):
    """The QAT reference's gradients for z, the router weights and W1/W3/W2 equal plain fp64 autograd of the expert
    computation run on the dequantized weights (leaves of their own), pair by pair."""
    E, L, I, N, k = 5, 32, 64, 6, 2
    experts = make_experts(E, L, I, mode, seed=1)
    z, idx, w = expert_inputs(N, k, E, L, seed=2)
    params = (experts.w1, experts.w3, experts.w2)
    deq = [mx_fake_quantize(p.detach(), "e2m1", 32, mode).requires_grad_() for p in params]
    want = per_pair_oracle(z, idx, w, *deq, mode)
    got = experts.forward_reference(z, idx, w)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(got)
    g_got = torch.autograd.grad(got, (z, w, *params), dy)
    g_want = torch.autograd.grad(want, (z, w, *deq), dy)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", SCALE_MODES)
def test_reference_grouped_and_gathered_agree_under_qat(mode):
    """Outputs and every gradient (z, weights, w1, w3, w2) of the three paths, fp64; grouped at two alignments."""
    E, L, I, N, k = 6, 64, 32, 9, 3
    experts = make_experts(E, L, I, mode, seed=3)
    z, idx, w = expert_inputs(N, k, E, L, seed=4)
    params = (z, w, experts.w1, experts.w3, experts.w2)
    ref = experts.forward_reference(z, idx, w)
    dy = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, params, dy)
    args = (z, idx, w, experts.w1, experts.w3, experts.w2, 4.0, 25.0, mode)
    for out in (qat_grouped_latent_experts(*args, align=1), qat_grouped_latent_experts(*args, align=8),
                qat_gathered_latent_experts(*args)):
        assert out.dtype == torch.float64 and out.shape == (N, L)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for a, b in zip(torch.autograd.grad(out, params, dy), g_ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # QAT changes the result (the quantizers are in the path), and the unused expert gets no gradient
    plain = LatentExperts(E, L, I, 4.0, 25.0, impl="reference").double()
    plain.load_state_dict(experts.state_dict())
    assert (plain.forward_reference(z, idx, w) - ref).abs().max() > 1e-3
    assert torch.equal(g_ref[2][E - 1], torch.zeros_like(g_ref[2][E - 1]))


def test_layer_dispatches_to_the_qat_paths():
    """`LatentExperts.forward` under QAT: grouped (many pairs) and gathered (few pairs) equal the reference, and
    the per-expert helper `expert` quantizes too."""
    E, L, I = 16, 32, 32
    experts = make_experts(E, L, I, "rceil", seed=5, dtype=torch.float32)
    g = torch.Generator().manual_seed(6)
    for N, k in ((20, 2), (3, 2)):  # N·k > E/2: grouped; N·k ≤ E/2: gathered
        z = torch.randn(N, L, generator=g)
        idx, w = routes(N, k, E, seed=N), torch.rand(N, k, generator=g)
        experts.impl = "grouped"
        fast = experts(z, idx, w)
        experts.impl = "reference"
        torch.testing.assert_close(fast, experts(z, idx, w), rtol=1e-5, atol=1e-6)
    z = torch.randn(4, L, generator=g)
    one = experts.forward_reference(z, torch.full((4, 1), 3), torch.ones(4, 1))
    torch.testing.assert_close(experts.expert(3, z), one, rtol=1e-5, atol=1e-6)


def test_bad_block_width_is_refused():
    with pytest.raises(ValueError, match="multiple of the block size"):
        fake_quantize_ste(torch.ones(2, 48), "e2m1", "rceil")


@pytest.mark.gpu
def test_cuda_grouped_and_graph_captured_gathered_paths():
    """On CUDA in bf16: the QAT grouped path (torch._grouped_mm, no host sync) against the QAT reference under
    autocast, output and gradients within bf16 error; the gathered path captured in a CUDA graph (as the engine's
    decode steps are) follows in-place weight updates on replay, as an eager call does."""
    E, L, I, N, k = 32, 256, 192, 1024, 4
    experts = make_experts(E, L, I, "rceil", seed=7, dtype=torch.float32).cuda()
    experts.impl = "grouped"
    g = torch.Generator(device="cuda").manual_seed(8)
    z = torch.randn(N, L, device="cuda", generator=g)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, device="cuda", generator=g)
    params = (experts.w1, experts.w3, experts.w2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        zb = z.bfloat16().requires_grad_()
        ref = experts.forward_reference(zb, idx, w)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = qat_grouped_latent_experts(zb, idx, w, *params, 4.0, 25.0, "rceil")
        finally:
            torch.cuda.set_sync_debug_mode(0)
    dy = torch.randn_like(ref)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(out, ref) <= 2e-2
    for a, b in zip(torch.autograd.grad(out, (zb, *params), dy), torch.autograd.grad(ref, (zb, *params), dy)):
        assert rel(a, b) <= 5e-2

    few_z, few_idx, few_w = z[:4].bfloat16(), idx[:4], w[:4]
    with torch.no_grad():
        static = qat_gathered_latent_experts(few_z, few_idx, few_w, *params, 4.0, 25.0, "rceil")  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = qat_gathered_latent_experts(few_z, few_idx, few_w, *params, 4.0, 25.0, "rceil")
        experts.w2.mul_(1.5)
        graph.replay()
        eager = qat_gathered_latent_experts(few_z, few_idx, few_w, *params, 4.0, 25.0, "rceil")
    assert torch.equal(static, eager)
