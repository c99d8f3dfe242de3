"""The chunked lm_head + cross-entropy against the full-logits reference.

Tolerances: fp64, chunked vs reference, loss and gradients ≤ 1e-12 (relative); bf16 autocast, both against
the fp64 result: the chunked error at most 1.5× the reference's (they round the same GEMM operands).
"""

import pytest
import torch

from k3.config import get_preset
from k3.model.model import build_model
from k3.ops.cross_entropy import chunked_linear_cross_entropy, linear_cross_entropy, naive_linear_cross_entropy


def _inputs(N=37, D=16, V=50, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g, dtype=dtype) / D**0.5).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    y[[3, min(10, N - 2), N - 1]] = -100
    return h, w, y


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("chunk_rows", [1, 5, 36, 37, 1000])
def test_chunked_equals_reference_fp64(chunk_rows):
    h, w, y = _inputs()
    ref = naive_linear_cross_entropy(h, w, y)
    gh, gw = torch.autograd.grad(ref * 0.37, (h, w))
    out = chunked_linear_cross_entropy(h, w, y, chunk_rows=chunk_rows)
    ch, cw = torch.autograd.grad(out * 0.37, (h, w))
    assert out.dtype == torch.float64
    assert abs(out.item() - ref.item()) <= 1e-12 * abs(ref.item())
    assert _rel(ch, gh) <= 1e-12 and _rel(cw, gw) <= 1e-12
    assert ch[3].abs().max() == 0 and ch[10].abs().max() == 0  # ignored rows get no gradient


def test_gradcheck():
    h, w, y = _inputs(N=9, D=5, V=7)
    assert torch.autograd.gradcheck(lambda a, b: chunked_linear_cross_entropy(a, b, y, chunk_rows=4), (h, w))


def test_bf16_autocast_no_worse_than_reference():
    h, w, y = _inputs(N=300, D=64, V=1000, dtype=torch.float32, seed=1)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exact = naive_linear_cross_entropy(h64, w64, y)
    eh, ew = torch.autograd.grad(exact, (h64, w64))
    errors = {}
    for name, fn in (("reference", naive_linear_cross_entropy),
                     ("chunked", lambda a, b, c: chunked_linear_cross_entropy(a, b, c, chunk_rows=64))):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(h, w, y)
        gh, gw = torch.autograd.grad(loss, (h, w))
        assert loss.dtype == torch.float32 and gh.dtype == torch.float32 and gw.dtype == torch.float32
        errors[name] = [abs(loss.item() - exact.item()) / exact.item(), _rel(gh.double(), eh), _rel(gw.double(), ew)]
    for ref_err, chunk_err in zip(errors["reference"], errors["chunked"]):
        assert chunk_err <= 1.5 * ref_err + 1e-6, errors
    assert max(errors["chunked"]) < 2e-2, errors


def test_evaluation_and_partial_gradients():
    h, w, y = _inputs()
    ref = naive_linear_cross_entropy(h, w, y)
    with torch.no_grad():
        assert torch.allclose(chunked_linear_cross_entropy(h, w, y, chunk_rows=8), ref, rtol=1e-12)
    # only the weight wants a gradient (a frozen trunk)
    (gw,) = torch.autograd.grad(chunked_linear_cross_entropy(h.detach(), w, y, chunk_rows=8), (w,))
    (rw,) = torch.autograd.grad(naive_linear_cross_entropy(h.detach(), w, y), (w,))
    assert _rel(gw, rw) <= 1e-12


def test_all_ignored_and_nonfinite_ignored_rows():
    h, w, y = _inputs()
    loss = chunked_linear_cross_entropy(h, w, torch.full_like(y, -100), chunk_rows=8)
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert loss.item() == 0 and gh.abs().max() == 0 and gw.abs().max() == 0
    # an ignored row whose logits overflow must not reach the loss
    h_bad = h.detach().clone()
    h_bad[3] = float("inf")
    keep = torch.ones(len(y), dtype=torch.bool)
    keep[3] = False
    loss = chunked_linear_cross_entropy(h_bad, w.detach(), y, chunk_rows=8)
    assert torch.isfinite(loss)
    assert torch.allclose(loss, naive_linear_cross_entropy(h.detach()[keep], w.detach(), y[keep]), rtol=1e-12)


def test_bad_inputs():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="hidden"):
        chunked_linear_cross_entropy(h, w[:, :3], y)
    with pytest.raises(ValueError, match="labels"):
        chunked_linear_cross_entropy(h, w, y[:5])
    with pytest.raises(ValueError, match="integer"):
        chunked_linear_cross_entropy(h, w, y.double())
    with pytest.raises(ValueError, match="chunk_rows"):
        chunked_linear_cross_entropy(h, w, y, chunk_rows=0)
    with pytest.raises(ValueError, match="impl"):
        linear_cross_entropy(h, w, y, impl="fused")


def test_model_loss_with_labels_equals_logits_loss():
    """model(ids, labels=...) — the path training takes — against cross-entropy of the returned logits."""
    config = get_preset("debug", loss_impl="chunked")
    model = build_model(config, seed=0, dtype=torch.float64)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    cu = torch.tensor([0, 10, 24, 48])
    out = model(ids, cu_seqlens=cu, labels=labels)
    assert out.logits is None
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    logits = model(ids, cu_seqlens=cu).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
    assert abs(out.loss.item() - ref.item()) <= 1e-10 * abs(ref.item())
    for p, a, b in zip(params, grads, ref_grads):
        if b is None:
            assert a is None or a.abs().max() == 0
        else:
            assert _rel(a, b) <= 1e-10 or (b.norm() == 0 and a.norm() == 0)
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=labels[:, :5])
    bad = labels.clone()
    bad[0, 3] = config.vocab_size  # the Triton row kernel would read past its row: refused up front
    with pytest.raises(ValueError, match="labels must be in"):
        model(ids, labels=bad)
    bad[0, 3] = -7  # neither a class nor ignore_index
    with pytest.raises(ValueError, match="labels must be in"):
        model(ids, labels=bad)
