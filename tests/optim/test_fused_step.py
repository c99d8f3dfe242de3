"""The fused optimizer step (`MuonAdamW(impl="fused")`) against the foreach reference (`impl="reference"`).

- AdamW runs `torch._fused_adamw_`, which has a CPU kernel: tested here in-process. Same formula, other
  op order (W −= ηλ·W against W·(1 − ηλ); β·M + (1 − β)·G against lerp), so not bit for bit: after five
  steps fp32 parameters agree to 1e-6 relative, bf16 ones to one bf16 ulp, the moments to 1e-5.
- Muon's Triton kernels and whole steps: on a GPU in-process and bit for bit (Newton–Schulz gets the same
  bf16 input); on CPU through the Triton interpreter in a subprocess (`test_in_triton_interpreter`), where fma
  is a product then a sum and fp32 → bf16 truncates: fp32 to 1e-6 relative, bf16 to two ulps.
- Checkpoints of either path load into the other.
"""

import copy
import io

import pytest
import torch

from k3.config import get_preset
from k3.model.model import build_model
from k3.optim import MuonAdamW, param_rule
from tests.interpreter import kernel_device, rerun_in_interpreter

CONFIG = get_preset("debug")
BF16_ULP = 2.0 ** -7  # relative spacing of bf16 values, at most


@pytest.fixture
def dev():
    return kernel_device()


def same(got, want, exact):
    """Bitwise on a GPU; within the interpreter's rounding on CPU: fp32 1e-6, bf16 two ulps (a bf16 parameter is
    stored twice in the update, mul_ then add_, and each store truncates there), relative to the tensor's
    largest value (an update that cancels the decayed weight leaves a small result with a large relative error)."""
    if exact:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()
    else:
        rtol = 2 * BF16_ULP if got.dtype == torch.bfloat16 else 1e-6
        scale = want.float().abs().max().item() if want.numel() else 0.0
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * scale)


def adamw_named(model):
    return [(n, p) for n, p in model.named_parameters() if param_rule(n, p, CONFIG).kind == "adamw"]


# ---- AdamW: torch._fused_adamw_ (CPU kernel) --------------------------------------------------------------

def steps_pair(model, impls, steps, device="cpu", ns_dtype=None, named=None, seed=0):
    """Copies of `model` stepped by one optimizer per impl on identical random gradients."""
    models = [copy.deepcopy(model) for _ in impls]
    opts = [MuonAdamW(named(m) if named else m.named_parameters(), CONFIG, lr=3e-3, weight_decay=0.1,
                      ns_dtype=ns_dtype, impl=impl) for m, impl in zip(models, impls)]
    g = torch.Generator(device=device).manual_seed(seed)
    for _ in range(steps):
        for ps in zip(*(m.parameters() for m in models)):
            grad = torch.randn(ps[0].shape, generator=g, device=device).to(ps[0].dtype)
            for p in ps:
                p.grad = grad.clone()
        for opt in opts:
            opt.step()
    return models, opts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adamw_equals_reference(dtype):
    model = build_model(CONFIG, seed=0, dtype=dtype)
    (ref, fused), (ref_opt, fused_opt) = steps_pair(model, ["reference", "fused"], 5, named=adamw_named)
    assert not fused_opt.param_groups[0]["params"]  # AdamW only: no Triton kernel on this CPU
    rtol = BF16_ULP if dtype == torch.bfloat16 else 1e-6
    for name, p0 in adamw_named(model):
        a, b = ref.get_parameter(name), fused.get_parameter(name)
        torch.testing.assert_close(b, a, rtol=rtol, atol=1e-7, msg=name)
    assert not torch.equal(ref.model.embed_tokens.weight, model.model.embed_tokens.weight)  # it moved
    for p, q in zip(ref_opt.param_groups[1]["params"], fused_opt.param_groups[1]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused_opt.state[q][key], ref_opt.state[p][key], rtol=1e-5, atol=1e-12)
        assert fused_opt.state[q]["step"] == ref_opt.state[p]["step"] == 5


def test_impl_is_validated_and_not_saved():
    model = build_model(CONFIG, seed=0)
    with pytest.raises(ValueError, match="impl"):
        MuonAdamW(model.named_parameters(), CONFIG, lr=1e-3, impl="triton")
    opt = MuonAdamW(model.named_parameters(), CONFIG, lr=1e-3, impl="reference")
    assert all("impl" not in g for g in opt.state_dict()["param_groups"])


# ---- Muon kernels: on a GPU, or in the interpreter ------------------------------------------------------

test_in_triton_interpreter = rerun_in_interpreter(__file__)


SIZES = [(3, 5), (4100,), (2, 70, 33), (0, 8), (8193,)]  # odd, > BLOCK, 3-D, empty, 2·BLOCK + 1


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_muon_momentum_equals_foreach(dev, grad_dtype, ns_dtype):
    from k3.optim.fused_muon import muon_momentum

    g = torch.Generator(device=dev).manual_seed(0)
    grads = [torch.randn(s, generator=g, device=dev).to(grad_dtype) for s in SIZES]
    bufs = [torch.randn(s, generator=g, device=dev) for s in SIZES]
    ref_bufs = [b.clone() for b in bufs]
    for mu in (0.95, 0.3):  # both branches of lerp for each of the two lerps
        gf = [x.float() for x in grads]
        torch._foreach_lerp_(ref_bufs, gf, 1 - mu)
        want = [n.to(ns_dtype) for n in torch._foreach_lerp(gf, ref_bufs, mu)]
        got = muon_momentum(bufs, grads, mu, ns_dtype)
        for a, b, x, y in zip(got, want, bufs, ref_bufs):
            assert a.dtype == ns_dtype and a.shape == b.shape
            same(a, b, dev == "cuda")
            same(x, y, dev == "cuda")


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("o_dtype", [torch.float32, torch.bfloat16])
def test_muon_update_equals_mul_add(dev, w_dtype, o_dtype):
    from k3.optim.fused_muon import muon_update

    g = torch.Generator(device=dev).manual_seed(1)
    weights = [torch.randn(s, generator=g, device=dev).to(w_dtype) for s in SIZES]
    updates = [torch.randn(s, generator=g, device=dev).to(o_dtype) for s in SIZES]
    updates[2] = updates[2].mT.contiguous().mT  # a transposed update, as Newton–Schulz returns tall blocks
    alphas = [-0.01 * (i + 1) for i in range(len(SIZES))]
    ref = [w.clone() for w in weights]
    for w, o, alpha in zip(ref, updates, alphas):
        w.mul_(1 - 0.02 * 0.1)
        w.add_(o, alpha=alpha)
    muon_update(weights, updates, 1 - 0.02 * 0.1, alphas)
    for a, b in zip(weights, ref):
        same(a, b, dev == "cuda")


def test_whole_steps_and_checkpoints_both_ways(dev):
    """Debug model, 3 steps: the Muon parameters equal the reference (bitwise on a GPU with bf16 Newton–Schulz),
    AdamW's within the fused kernel's rounding; then each optimizer's state dict drives the other one step."""
    ns_dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = build_model(CONFIG, seed=0, device=dev)
    (ref, fused), (ref_opt, fused_opt) = steps_pair(model, ["reference", "fused"], 3, dev, ns_dtype)
    names = set(ref_opt.param_groups[0]["param_names"])
    for (name, a), b in zip(ref.named_parameters(), fused.parameters()):
        if name in names:
            same(b, a, dev == "cuda")
        else:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
    # swap the optimizers' states: fused continues from the reference's checkpoint and the other way round
    states = []
    for opt in (ref_opt, fused_opt):
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        states.append(torch.load(buf, weights_only=True))
    for m, opt, state in ((ref, ref_opt, states[1]), (fused, fused_opt, states[0])):
        opt.load_state_dict(state)
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        assert all(torch.isfinite(p).all() for p in m.parameters())
        assert all(s["step"] == 4 for s in opt.state.values() if "step" in s)
