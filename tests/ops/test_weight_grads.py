"""Weight gradients added into .grad where they are computed (k3.ops.weight_grads): the helpers' contract, and the
whole model's gradients over micro-batches equal to the engine's (fp32 on CPU; the Triton expert kernel's
accumulation is checked in the interpreter, tests/ops/triton_interpreter_checks.py)."""

import pytest
import torch

from k3.config import get_preset
from k3.model.checkpointing import apply_activation_checkpointing
from k3.model.model import build_model
from k3.ops import weight_grads
from k3.ops.weight_grads import accumulates, accumulating_weight_grads, add_gradient, add_product


def test_helpers_return_the_gradient_when_off_and_add_it_when_on():
    p = torch.nn.Parameter(torch.randn(3, 4))
    a, b = torch.randn(3, 5), torch.randn(5, 4)
    assert not accumulates(p)
    torch.testing.assert_close(add_product(p, a, b), a @ b)
    with accumulating_weight_grads():
        assert accumulates(p)
        assert add_product(p, a, b) is None
        torch.testing.assert_close(p.grad, a @ b)
        assert add_product(p, a, b) is None
        torch.testing.assert_close(p.grad, 2 * (a @ b))
        g, scale = torch.randn(3, 4), torch.tensor(0.5)
        assert add_gradient(p, g, scale) is None
        torch.testing.assert_close(p.grad, 2 * (a @ b) + 0.5 * g)
    assert not weight_grads._ACCUMULATING  # restored on exit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_gradient_in_another_dtype_lands_in_fp32(dtype):
    """A 16-bit or fp64 gradient (times a 0-dim fp32 scale, which does not promote) becomes an fp32 .grad."""
    p = torch.nn.Parameter(torch.randn(3, 4))
    g, scale = torch.randn(3, 4, dtype=dtype), torch.tensor(0.25)
    with accumulating_weight_grads():
        assert add_gradient(p, g, scale) is None
        assert p.grad.dtype == torch.float32
        add_gradient(p, g, scale)
        add_product(p, g[:, :2].contiguous(), torch.ones(2, 4, dtype=dtype))
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else {}  # CPU rounds a bf16 product to bf16
    torch.testing.assert_close(p.grad, (0.5 * g.double() + g[:, :2].double().sum(1, keepdim=True)).float(), **tol)


def test_frozen_experts_get_no_gradient_and_the_others_do():
    """The expert function with w3 frozen: w1 and w2 accumulate in place, w3 gets nothing, as with the engine."""
    from k3.model.moe import LatentExperts
    from k3.ops.moe import grouped_latent_experts

    torch.manual_seed(0)
    experts = LatentExperts(4, 8, 6, 4.0, 25.0)  # uninitialised parameters until build_model's init
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.3)
    experts.w3.requires_grad_(False)
    z, idx, w = torch.randn(10, 8), torch.randint(0, 4, (10, 2)), torch.rand(10, 2)
    grads = []
    for accumulate in (False, True):
        for p in experts.parameters():
            p.grad = None
        with accumulating_weight_grads(accumulate):
            grouped_latent_experts(z, idx, w, experts.w1, experts.w3, experts.w2, 4.0, 25.0).sum().backward()
        assert experts.w3.grad is None
        grads.append([experts.w1.grad.clone(), experts.w2.grad.clone()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_helpers_leave_what_they_cannot_own_to_the_engine():
    with accumulating_weight_grads():
        assert not accumulates(torch.randn(3, 4, requires_grad=True) * 2)  # not a leaf
        assert not accumulates(torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64)))  # not fp32
        assert not accumulates(torch.randn(3, 4))  # no gradient wanted
        fresh = torch.nn.Parameter(torch.randn(3, 4))
        g = torch.randn(3, 4)
        add_gradient(fresh, g)
        assert fresh.grad.data_ptr() != g.data_ptr()  # never aliases the caller's tensor
    with accumulating_weight_grads(False):
        assert not accumulates(torch.nn.Parameter(torch.randn(3, 4)))


def _micro_batches(config, n=3):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=g)
        out.append((ids, torch.roll(ids, -1, 1), torch.tensor([0, 7, 16, 20, 32])))
    return out


def _accumulated_grads(model, batches, accumulate):
    model.zero_grad(set_to_none=True)
    for ids, labels, cu in batches:
        with accumulating_weight_grads(accumulate):
            (model(ids, cu_seqlens=cu, labels=labels).loss / 100).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("ckpt", [False, True])
def test_model_gradients_over_micro_batches_equal_the_engines(monkeypatch, ckpt):
    """Three micro-batches of the debug model (grouped MoE, fused projections, chunked loss) in fp32: every
    parameter's .grad as the engine accumulates it, within fp32 summation order; and the sites did take the
    parameters' gradients (the routed experts, the head, the fused projections)."""
    config = get_preset("debug").replace(moe_impl="grouped", loss_impl="chunked")
    model = build_model(config, seed=0)
    if ckpt:
        apply_activation_checkpointing(model)
    batches = _micro_batches(config)
    engine = _accumulated_grads(model, batches, False)
    taken = []
    for name in ("add_product", "add_gradient"):
        original = getattr(weight_grads, name)

        def recording(param, *args, _original=original, **kwargs):
            out = _original(param, *args, **kwargs)
            if out is None:
                taken.append(param)
            return out
        for module in ("k3.model.projections", "k3.ops.moe", "k3.ops.cross_entropy"):
            if hasattr(__import__(module, fromlist=[name]), name):
                monkeypatch.setattr(f"{module}.{name}", recording)
    fused = _accumulated_grads(model, batches, True)
    assert fused.keys() == engine.keys()
    for name in engine:
        torch.testing.assert_close(fused[name], engine[name], rtol=1e-5, atol=1e-7, msg=name)
    owned = {id(p) for p in taken}
    names = {n for n, p in model.named_parameters() if id(p) in owned}
    assert any(n.endswith("experts.w1") for n in names), sorted(names)
    assert any(n.endswith("experts.w2") for n in names)
    assert "lm_head.weight" in names
    assert any("q_proj" in n for n in names)  # KDA's fused projections
