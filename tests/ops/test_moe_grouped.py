"""Grouped-GEMM routed experts (k3.ops.moe) against the reference dispatch of `LatentExperts`.

Legend: N tokens, k experts per token, E experts, L latent width, I expert hidden width.
"""

import pytest
import torch

from k3.config import get_preset
from k3.model.moe import LatentExperts, StableLatentMoE
from k3.ops.moe import (_grouped_situ_glu, dispatch_plan, gmm, gmm_wgrad, grouped_latent_experts, grouped_situ_glu,
                        naive_grouped_situ_glu)


def make_experts(E, L, I, seed=0, dtype=torch.float64, std=0.3):
    torch.manual_seed(seed)
    experts = LatentExperts(E, L, I, 4.0, 25.0)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, std)
    return experts.to(dtype)


def skewed_routes(N, k, E, seed):
    """Top-k routes with a Zipf-like skew: expert 0 is in every token's set, the last expert in none."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E - 2, generator=g)[: k - 1] + 1 for _ in range(N)])
    return torch.cat([torch.zeros(N, 1, dtype=torch.int64), idx], dim=1)  # expert E-1 unused


def inputs(N, k, E, L, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, L, generator=g, dtype=dtype).requires_grad_()
    w = torch.rand(N, k, generator=g, dtype=dtype).requires_grad_()
    return z, skewed_routes(N, k, E, seed), w


def test_dispatch_plan_places_every_pair_in_its_padded_group():
    idx = skewed_routes(13, 3, 7, seed=1)
    for align in (1, 8):
        dest, offs, rows = dispatch_plan(idx, 7, align)
        assert rows == -(-39 // align) * align + 7 * align and offs[-1].item() == rows
        assert dest.unique().numel() == 39  # a permutation into the padded rows
        ends = offs.tolist()
        starts = [0] + ends[:-1]
        for e in range(7):
            assert (ends[e] - starts[e]) % align == 0 and ends[e] - starts[e] >= align  # aligned, never empty
            mine = dest[idx.reshape(-1) == e]
            assert ((mine >= starts[e]) & (mine < ends[e])).all()


@pytest.mark.parametrize("align", [1, 8])
def test_grouped_experts_equal_reference_fp64(align):
    """Output and every gradient (z, weights, w1, w3, w2) equal the padded-batch reference: fp64 ≤ 1e-12."""
    E, L, I, N, k = 6, 16, 8, 23, 3
    experts = make_experts(E, L, I, seed=2)
    z, idx, w = inputs(N, k, E, L, seed=3)
    ref = experts.forward_reference(z, idx, w)
    out = grouped_latent_experts(z, idx, w, experts.w1, experts.w3, experts.w2, 4.0, 25.0, align=align)
    assert out.dtype == torch.float64 and out.shape == (N, L)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    dy = torch.randn_like(ref)
    params = (z, w, experts.w1, experts.w3, experts.w2)
    g_ref = torch.autograd.grad(ref, params, dy)
    g_out = torch.autograd.grad(out, params, dy)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    # the unused expert gets exactly zero gradient, as in the reference
    assert experts.w1.shape[0] - 1 not in idx and torch.equal(g_out[2][-1], torch.zeros_like(g_out[2][-1]))


def test_gradient_transform_gradcheck_fp64():
    """The custom autograd Function (router-weight gradient from the activation) under float64 gradcheck."""
    E, L, I, N, k = 4, 8, 4, 7, 2
    experts = make_experts(E, L, I, seed=4)
    z, idx, w = inputs(N, k, E, L, seed=5)

    def f(z, w, w1, w3, w2):
        return grouped_latent_experts(z, idx, w, w1, w3, w2, 4.0, 25.0, align=4)

    assert torch.autograd.gradcheck(f, (z, w, experts.w1, experts.w3, experts.w2), eps=1e-6, atol=1e-7)


def test_expert_outputs_are_not_saved():
    """The transform saves the rows and the pre-activations, not the [M, L] expert outputs: fewer saved
    bytes than the reference autograd graph for the same call."""
    E, L, I, N, k = 8, 64, 16, 64, 4
    experts = make_experts(E, L, I, seed=6, dtype=torch.float32)
    z, idx, w = inputs(N, k, E, L, seed=7, dtype=torch.float32)

    def saved_bytes(fn):
        seen = {}

        def pack(t):
            seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(seen.values())

    fast = saved_bytes(lambda: grouped_latent_experts(z, idx, w, experts.w1, experts.w3, experts.w2, 4.0, 25.0))
    ref = saved_bytes(lambda: experts.forward_reference(z, idx, w))
    weights = sum(p.numel() * p.element_size() for p in experts.parameters())
    # the fast path saves the concatenated [E, 2I, L] w1|w3 once more; activations are far smaller
    assert fast - weights < 0.6 * (ref - weights)


def test_grouped_situ_glu_public_equals_loop_reference():
    """`grouped_situ_glu` (the EP entry point) vs the per-expert loop: empty groups, fp64 ≤ 1e-12, gradcheck."""
    E, L, I = 6, 16, 8
    experts = make_experts(E, L, I, seed=8)
    sizes = torch.tensor([3, 0, 5, 1, 0, 2])
    x = torch.randn(11, L, dtype=torch.float64, requires_grad=True)
    params = (x, experts.w1, experts.w3, experts.w2)
    ref = naive_grouped_situ_glu(x, sizes, *params[1:], 4.0, 25.0)
    out = grouped_situ_glu(x, sizes, *params[1:], 4.0, 25.0)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    dy = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, params, dy), torch.autograd.grad(ref, params, dy)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    small = make_experts(3, 8, 4, seed=9)
    xs = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    s3 = torch.tensor([2, 0, 4])
    assert torch.autograd.gradcheck(lambda x, a, b, c: _grouped_situ_glu(x, s3, a, b, c, 4.0, 25.0, align=8),
                                    (xs, small.w1, small.w3, small.w2))
    with pytest.raises(ValueError):
        grouped_situ_glu(x, sizes[:3], *params[1:], 4.0, 25.0)


def test_native_grouped_mm_matches_loop_fp32():
    """torch._grouped_mm (forced on CPU, fp32) equals the per-group loop for all three GEMM layouts."""
    g = torch.Generator().manual_seed(10)
    offs = torch.tensor([8, 16, 16 + 24, 48], dtype=torch.int32)
    a = torch.randn(48, 16, generator=g)
    w = torch.randn(4, 32, 16, generator=g)
    dy = torch.randn(48, 32, generator=g)
    for native_out, loop_out in [
        (gmm(a, w.transpose(1, 2), offs, True), gmm(a, w.transpose(1, 2), offs, False)),
        (gmm(dy, w, offs, True), gmm(dy, w, offs, False)),
        (gmm_wgrad(dy.t(), a, offs, True), gmm_wgrad(dy.t(), a, offs, False)),
    ]:
        torch.testing.assert_close(native_out, loop_out, atol=1e-5, rtol=1e-5)


def test_moe_layer_grouped_equals_reference():
    """A whole StableLatentMoE with moe_impl=grouped vs reference (fp64 ≤ 1e-12, outputs and all grads)."""
    config = get_preset("debug")
    torch.manual_seed(11)
    ref = StableLatentMoE(config.replace(moe_impl="reference"))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.1)
    ref = ref.double()
    fast = StableLatentMoE(config.replace(moe_impl="grouped")).double()
    fast.load_state_dict(ref.state_dict())
    assert fast.experts.impl == "grouped" and ref.experts.impl == "reference"
    h = torch.randn(2, 9, config.hidden_size, dtype=torch.float64)
    a, b = fast(h), ref(h)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    a.pow(2).sum().backward()
    b.pow(2).sum().backward()
    for (name, p), q in zip(fast.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-11, rtol=1e-11, msg=name)


def test_native_layouts_inside_the_expert_function():
    """The whole fast path with torch._grouped_mm forced (CPU, fp32, align 8): the operand layouts the
    CUDA path uses (transposed weights, transposed gradients) give the reference's outputs and gradients."""
    E, L, I, N, k = 8, 32, 24, 50, 3
    experts = make_experts(E, L, I, seed=12, dtype=torch.float32, std=0.2)
    z, idx, w = inputs(N, k, E, L, seed=13, dtype=torch.float32)
    ref = experts.forward_reference(z, idx, w)
    out = grouped_latent_experts(z, idx, w, experts.w1, experts.w3, experts.w2, 4.0, 25.0, align=8, native=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(ref)
    params = (z, w, experts.w1, experts.w3, experts.w2)
    for a, b in zip(torch.autograd.grad(out, params, dy), torch.autograd.grad(ref, params, dy)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
