"""SiTU-GLU and Stable LatentMoE (docs/architecture.md §5.1–§5.4).

Legend: N tokens, D model width, E experts, k experts per token, L latent width, I expert hidden width.
"""

import pytest
import torch
import torch.nn.functional as F

from k3.config import get_preset
from k3.model.moe import SiTUMLP, StableLatentMoE
from k3.ops.situ import naive_situ_glu

CONFIG = get_preset("debug")


def make_moe(seed: int = 0, dtype=torch.float64, std: float = 0.1) -> StableLatentMoE:
    """A debug-sized MoE with every weight N(0, std) (norm gain 1 + N(0, std)) so routing is not flat."""
    torch.manual_seed(seed)
    moe = StableLatentMoE(CONFIG)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if name.endswith("routed_expert_norm.weight"):
                p.copy_(1 + std * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    return moe.to(dtype)


def random_h(N: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, CONFIG.hidden_size, generator=g, dtype=dtype)


# ---- SiTU-GLU ----------------------------------------------------------------------------------

def situ_formula(g, u, b1=4.0, b2=25.0):
    """docs/architecture.md §5.3 written out: [β1 tanh(g/β1) σ(g)] · [β2 tanh(u/β2)]."""
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))


def test_situ_matches_formula_fp64():
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(2, 64, 33, generator=g, dtype=torch.float64) * 8
    assert torch.equal(naive_situ_glu(gate, up), situ_formula(gate, up))


def test_situ_gradcheck_fp64():
    g = torch.Generator().manual_seed(1)
    # spread over the linear region and into saturation of both tanh factors
    gate = (torch.randn(5, 7, generator=g, dtype=torch.float64) * 6).requires_grad_()
    up = (torch.randn(5, 7, generator=g, dtype=torch.float64) * 40).requires_grad_()
    assert torch.autograd.gradcheck(naive_situ_glu, (gate, up), eps=1e-6, atol=1e-6, rtol=1e-5)
    assert torch.autograd.gradcheck(lambda a, b: naive_situ_glu(a, b, 2.0, 3.0), (gate, up))


def test_situ_analytic_gradient():
    """The closed-form gradients of §5.3 against autograd (fp64, ≤ 1e-12)."""
    g = torch.Generator().manual_seed(2)
    gate = (torch.randn(100, generator=g, dtype=torch.float64) * 5).requires_grad_()
    up = (torch.randn(100, generator=g, dtype=torch.float64) * 30).requires_grad_()
    naive_situ_glu(gate, up).sum().backward()
    b1, b2 = 4.0, 25.0
    gd, ud = gate.detach(), up.detach()
    s = torch.sigmoid(gd)
    dg = ((1 / torch.cosh(gd / b1)) ** 2 * s + b1 * torch.tanh(gd / b1) * s * (1 - s)) * b2 * torch.tanh(ud / b2)
    du = b1 * torch.tanh(gd / b1) * s * (1 / torch.cosh(ud / b2)) ** 2
    torch.testing.assert_close(gate.grad, dg, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(up.grad, du, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_situ_bounded_at_extreme_inputs(dtype):
    vals = torch.tensor([-1e4, -1e3, -30.0, -1.0, 0.0, 1.0, 30.0, 1e3, 1e4], dtype=dtype)
    gate, up = torch.meshgrid(vals, vals, indexing="ij")
    f = naive_situ_glu(gate, up)
    assert torch.isfinite(f).all()
    # |f| ≤ β1·β2 = 100, attained (in floating point) at g = u = +1e4
    assert f.abs().max().item() <= 100.0
    assert f[-1, -1].item() == 100.0
    assert f[-1, 0].item() == -100.0
    # σ(−1e4) = 0: the negative-gate side vanishes
    assert (f[0] == 0).all()
    # gradients stay finite at the extremes
    gate32 = gate.double().requires_grad_()
    up32 = up.double().requires_grad_()
    naive_situ_glu(gate32, up32).sum().backward()
    assert torch.isfinite(gate32.grad).all() and torch.isfinite(up32.grad).all()


def test_situ_swiglu_limit_for_large_beta():
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(1000, generator=g, dtype=torch.float64) * 2
    up = torch.randn(1000, generator=g, dtype=torch.float64) * 2
    f = naive_situ_glu(gate, up, beta1=1e4, beta2=1e4)
    swiglu = F.silu(gate) * up
    # β tanh(x/β) = x (1 − x²/(3β²) + …): relative error ~ x²/β² ≈ 1e-7 at |x| ≲ 6
    rel = ((f - swiglu).abs() / swiglu.abs().clamp_min(1e-30)).max().item()
    assert rel < 1e-6
    # and β = 4/25 is visibly different from SwiGLU at the same inputs (the test would notice)
    assert (naive_situ_glu(gate, up) - swiglu).abs().max() > 1e-2


def test_situ_bf16_computed_in_fp32():
    g = torch.Generator().manual_seed(4)
    gate = (torch.randn(4096, generator=g) * 20).bfloat16()
    up = (torch.randn(4096, generator=g) * 80).bfloat16()
    out = naive_situ_glu(gate, up)
    assert out.dtype == torch.bfloat16
    # fp32 evaluation cast once to bf16: exact
    assert torch.equal(out, situ_formula(gate.float(), up.float()).bfloat16())


def test_situ_shape_mismatch_raises():
    with pytest.raises(ValueError):
        naive_situ_glu(torch.zeros(3, 4), torch.zeros(4, 3))


# ---- dense SiTU MLP ----------------------------------------------------------------------------

def test_dense_situ_mlp_by_hand():
    torch.manual_seed(5)
    mlp = SiTUMLP(CONFIG.hidden_size, CONFIG.intermediate_size, 4.0, 25.0).double()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.3)
    x = random_h(7, seed=6).view(1, 7, -1)
    gate = x @ mlp.gate_proj.weight.t()
    up = x @ mlp.up_proj.weight.t()
    ref = situ_formula(gate, up) @ mlp.down_proj.weight.t()
    # fp64: ≤ 1e-12
    torch.testing.assert_close(mlp(x), ref, atol=1e-12, rtol=1e-12)


# ---- Stable LatentMoE --------------------------------------------------------------------------

def dense_moe_reference(moe: StableLatentMoE, h: torch.Tensor) -> torch.Tensor:
    """§5.1 with a dense loop over ALL experts and a 0/1 selection mask; h [N, D] fp64 -> [N, D]."""
    W = moe.gate.weight
    E, k = W.shape[0], moe.top_k
    s = torch.sigmoid(h @ W.t())  # [N, E]
    biased = s + moe.gate.e_score_correction_bias.to(s.dtype)
    mask = torch.zeros_like(s)
    for n in range(h.shape[0]):
        for e in sorted(range(E), key=lambda e: -biased[n, e].item())[:k]:
            mask[n, e] = 1.0
    p = s * mask / ((s * mask).sum(-1, keepdim=True) + 1e-20) * moe.routed_scaling_factor
    z = h @ moe.routed_expert_down_proj.weight.t()  # [N, L]
    u = torch.zeros_like(z)
    for e in range(E):
        act = situ_formula(z @ moe.experts.w1[e].t(), z @ moe.experts.w3[e].t())
        u = u + p[:, e : e + 1] * (act @ moe.experts.w2[e].t())
    un = u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + CONFIG.rms_norm_eps) * moe.routed_expert_norm.weight
    routed = un @ moe.routed_expert_up_proj.weight.t()
    sh = moe.shared_experts
    shared = situ_formula(h @ sh.gate_proj.weight.t(), h @ sh.up_proj.weight.t()) @ sh.down_proj.weight.t()
    return shared + routed


@pytest.mark.parametrize("with_bias", [False, True])
def test_moe_equals_dense_loop_over_all_experts(with_bias):
    moe = make_moe(seed=7)
    if with_bias:
        with torch.no_grad():
            moe.gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, CONFIG.num_experts))
    h = random_h(2 * 13, seed=8)
    out = moe(h.view(2, 13, -1))
    assert out.shape == (2, 13, CONFIG.hidden_size)
    # fp64, same math with a different summation order: ≤ 1e-12
    torch.testing.assert_close(out.view(26, -1), dense_moe_reference(moe, h), atol=1e-12, rtol=1e-12)


def test_bias_changes_selection_but_never_weights():
    moe = make_moe(seed=9)
    h = random_h(64, seed=10)
    scores0, idx0, w0, _ = moe.route(h)
    # push the two least-chosen experts to the top: selection must change
    loads = torch.bincount(idx0.reshape(-1), minlength=CONFIG.num_experts)
    favoured = loads.argsort()[:2]
    bias = torch.zeros(CONFIG.num_experts)
    bias[favoured] = 0.5
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(bias)
    scores1, idx1, w1, _ = moe.route(h)
    assert torch.equal(scores1, scores0)  # the bias never touches the scores
    assert not torch.equal(idx1.sort(-1).values, idx0.sort(-1).values)
    assert set(favoured.tolist()) <= set(idx1.reshape(-1).tolist())
    # p = unbiased scores of the selected experts, renormalised: no trace of the bias
    sel = scores0.gather(1, idx1)
    assert torch.equal(w1, sel / (sel.sum(-1, keepdim=True) + 1e-20))
    # tokens whose selected set is unchanged get exactly the same weights per expert
    for n in range(h.shape[0]):
        if set(idx0[n].tolist()) == set(idx1[n].tolist()):
            a = dict(zip(idx0[n].tolist(), w0[n].tolist()))
            b = dict(zip(idx1[n].tolist(), w1[n].tolist()))
            assert a == b
    # a common shift of the bias changes nothing at all
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(bias + 0.25)
    _, idx2, w2, _ = moe.route(h)
    assert torch.equal(idx2, idx1) and torch.equal(w2, w1)


def test_routing_independent_of_batch_composition():
    moe = make_moe(seed=11)
    h = random_h(24, seed=12)
    batched = moe(h.view(3, 8, -1)).view(24, -1)
    _, idx_batched, _, _ = moe.route(h)
    for n in [0, 5, 17, 23]:
        alone = moe(h[n].view(1, 1, -1)).view(-1)
        _, idx_alone, _, _ = moe.route(h[n : n + 1])
        assert torch.equal(idx_alone[0], idx_batched[n])
        # fp64; only BLAS blocking may differ with the batch size: ≤ 1e-12
        torch.testing.assert_close(alone, batched[n], atol=1e-12, rtol=1e-12)
    # the same tokens in another order and batch shape give the same rows
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(13))
    shuffled = moe(h[perm].view(4, 6, -1)).view(24, -1)
    torch.testing.assert_close(shuffled, batched[perm], atol=1e-12, rtol=1e-12)


def test_gradients_reach_selected_experts_and_router_not_bias():
    moe = make_moe(seed=14)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, CONFIG.num_experts))
    h = random_h(6, seed=15)
    _, idx, _, _ = moe.route(h)
    selected = set(idx.reshape(-1).tolist())
    assert 1 < len(selected) < CONFIG.num_experts  # some experts stay unused with 6 tokens × top-2 of 16
    moe(h.view(1, 6, -1)).pow(2).sum().backward()
    for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        for e in range(CONFIG.num_experts):
            if e in selected:
                assert w.grad[e].abs().sum() > 0, f"selected expert {e} got no gradient"
            else:
                assert torch.equal(w.grad[e], torch.zeros_like(w.grad[e])), f"unused expert {e} got a gradient"
    # the router weight learns through p; the selection bias is a buffer and gets nothing
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    bias = moe.gate.e_score_correction_bias
    assert not bias.requires_grad and bias.grad is None
    assert "gate.e_score_correction_bias" not in dict(moe.named_parameters())
    assert "gate.e_score_correction_bias" in dict(moe.named_buffers())
    assert bias.dtype == torch.float32 or bias.dtype == torch.float64
    # every other parameter gets a gradient too
    for name, p in moe.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_router_logits_fp32_for_bf16_input():
    moe = make_moe(seed=16, dtype=torch.bfloat16)
    h = random_h(5, seed=17, dtype=torch.bfloat16)
    scores = moe.gate(h)
    assert scores.dtype == torch.float32
    ref = torch.sigmoid(h.float() @ moe.gate.weight.float().t())
    torch.testing.assert_close(scores, ref, atol=1e-6, rtol=1e-6)
    assert moe(h.view(1, 5, -1)).dtype == torch.bfloat16


def test_split_bf16_is_exact_above_2_to_the_minus_110():
    """Exact wherever the last part is still a normal bf16 (|x| ≥ 2^-110 ≈ 8e-34); below it only subnormal
    residues are lost (absolute error < 2^-133)."""
    from k3.ops.router import split_bf16

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-32, 37, 4096)
    x[:3] = torch.tensor([0.0, -0.0, 2.0 ** -110])
    parts = split_bf16(x)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    assert torch.equal((parts[2].float() + parts[1].float()) + parts[0].float(), x)


@pytest.mark.parametrize("scale", [1.0, 1e-3])
def test_split_router_logits_are_the_fp32_gemm(scale):
    """The split router (bf16 GEMMs on the weight's three bf16 parts) against fp64: logits and the weight gradient
    at fp32 accuracy (≤ 1e-6 relative, the fp32 GEMM's own error is of that order), the input gradient at bf16
    rounding (it is returned in bf16), each within 2x the fp32 reference path's error."""
    from k3.ops.router import router_logits_reference, split_router_logits

    g = torch.Generator().manual_seed(3)
    h = (torch.randn(300, 96, generator=g) * 2).bfloat16()
    w = torch.randn(24, 96, generator=g) * 0.05 * scale
    dy = torch.randn(300, 24, generator=g, dtype=torch.float64)
    ref_h, ref_w = h.double().requires_grad_(), w.double().requires_grad_()
    ref = ref_h @ ref_w.t()
    ref.backward(dy)
    results = {}
    for name, fn in (("split", split_router_logits), ("fp32", router_logits_reference)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(hh, ww)
        out.backward(dy.float())
        assert out.dtype == torch.float32 and hh.grad.dtype == torch.bfloat16 and ww.grad.dtype == torch.float32
        results[name] = [((a.double() - b).norm() / b.norm()).item()
                         for a, b in ((out, ref), (ww.grad, ref_w.grad), (hh.grad, ref_h.grad))]
    (logits, dw, dh), (logits32, dw32, dh32) = results["split"], results["fp32"]
    assert logits <= 1e-6 and dw <= 1e-6 and dh <= 4e-3, results
    assert logits <= 2 * logits32 + 1e-7 and dw <= 2 * dw32 + 1e-7 and dh <= 2 * dh32, results


def test_router_impl_switch():
    """"fast" runs the split wherever asked; "auto" splits on CUDA only (the CPU reference elsewhere)."""
    from k3.ops import router

    calls = []
    split = router.split_router_logits
    moe_module = __import__("k3.model.moe", fromlist=["split_router_logits"])
    original = moe_module.split_router_logits
    moe_module.split_router_logits = lambda *a: calls.append(1) or split(*a)
    try:
        for impl, expect in (("auto", 0), ("reference", 0), ("fast", 1)):
            calls.clear()
            moe = make_moe(seed=5, dtype=torch.float32)
            moe.gate.impl = impl
            h = random_h(7, seed=6).bfloat16()
            scores = moe.gate(h)
            assert len(calls) == expect and scores.dtype == torch.float32
            torch.testing.assert_close(scores, torch.sigmoid(h.float() @ moe.gate.weight.float().t()),
                                       atol=1e-6, rtol=1e-6)
    finally:
        moe_module.split_router_logits = original
    with pytest.raises(ValueError, match="router_impl"):
        get_preset("debug", router_impl="tf32")


def _assert_equals_reference(experts, path, topk):
    """`path` and `experts.forward_reference` on random fp64 tokens routed by `topk`: outputs and the gradients of
    z, the router weights and W1, W3, W2 equal to 1e-12."""
    (N, k), L = topk.shape, experts.w1.shape[2]
    z = torch.randn(N, L, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(N, k, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(N, L, dtype=torch.float64)
    leaves = (z, weights, experts.w1, experts.w3, experts.w2)
    results = []
    for forward in (path, experts.forward_reference):
        out = forward(z, topk, weights)
        results.append((out, *torch.autograd.grad((out * w_out).sum(), leaves)))
    for name, a, b in zip("out z weights w1 w3 w2".split(), *results):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=name)


@pytest.mark.parametrize("qat", [None, "rceil"])
def test_bucketed_experts_equal_the_padded_reference(qat):
    """The CPU path (experts in buckets of similar load) against `forward_reference` (one block padded to the busiest
    expert) on skewed loads: outputs and the gradients of z, the router weights and W1, W3, W2; fp64 to 1e-12."""
    from k3.model.moe import LatentExperts

    torch.manual_seed(40)
    E, L, I, N = 16, 32, 32, 40  # k = 3 (the top-k below)
    experts = LatentExperts(E, L, I, 4.0, 25.0, "auto", qat_scale_mode=qat).double()
    with torch.no_grad():
        for w in (experts.w1, experts.w3, experts.w2):
            w.normal_(0.0, 0.2)
    # skewed: expert 0 in every token's top-k, experts 1-3 often, 12-15 never
    topk = torch.stack([torch.zeros(N, dtype=torch.long), torch.randint(1, 4, (N,)), torch.randint(4, 12, (N,))], 1)
    _assert_equals_reference(experts, experts.forward_bucketed, topk)


@pytest.mark.parametrize("qat", [None, "rceil"])
def test_few_pairs_on_the_cpu_gather_their_experts(qat, monkeypatch):
    """A decode or verify step on the CPU (N·k ≤ E/2 pairs, `moe_impl` auto) takes the gathered experts, not the
    buckets, and equals `forward_reference`: outputs and gradients, fp64 to 1e-12."""
    from k3.model.moe import LatentExperts

    torch.manual_seed(41)
    E, L, I, N, k = 32, 32, 32, 5, 3  # 15 pairs ≤ 16; MX blocks of 32 along L and I
    experts = LatentExperts(E, L, I, 4.0, 25.0, "auto", qat_scale_mode=qat).double()
    with torch.no_grad():
        for w in (experts.w1, experts.w3, experts.w2):
            w.normal_(0.0, 0.2)
    monkeypatch.setattr(experts, "forward_bucketed", None)  # a call to the buckets would fail
    topk = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    _assert_equals_reference(experts, experts.forward, topk)
