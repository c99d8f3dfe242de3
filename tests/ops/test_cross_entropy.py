"""The chunked lm_head + cross-entropy against the full-logits reference; the Triton row kernel's launch forms
against the torch formula (on a GPU, or in the Triton interpreter: a subprocess on CPU).

Tolerances: fp64, chunked vs reference, loss and gradients ≤ 1e-12 (relative); bf16 autocast, both against
the fp64 result: the chunked error at most 1.5× the reference's (they round the same GEMM operands). Row
kernel vs torch formula on the same logits: fp32 ≤ 1e-5 (loss, relative) and 1e-6 (gradient, absolute); bf16
gradients within one bf16 step (2^-7 relative); the whole loss with the kernel, fp32 vs fp64: ≤ 1e-5.
"""

import pytest
import torch

from k3.config import get_preset
from k3.model.model import build_model
from k3.ops import cross_entropy as ce
from k3.ops.cross_entropy import chunked_linear_cross_entropy, linear_cross_entropy, naive_linear_cross_entropy
from tests.interpreter import INTERPRETING, kernel_device, rerun_in_interpreter
# the persistent form at test shapes: 3 programs (`_multiprocessors` is patched to 1 SM below), tiles of 128
PERSISTENT = dict(form="persistent", programs_per_sm=3, BV=128, warps=4, stages=2, reverse=True)
FORMS = {"per_row": dict(ce.LOSS_ROWS, BV=128), "persistent": PERSISTENT,
         "persistent_forward": dict(PERSISTENT, BV=256, stages=None, reverse=False)}


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


@pytest.mark.skipif(INTERPRETING, reason="no kernel: runs in the main process")
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


@pytest.mark.skipif(INTERPRETING, reason="no kernel: runs in the main process")
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


def test_chunk_rows_rule():
    """Without chunk_rows: the row kernel's chunks hold ~2x the torch formula's rows in bf16 (its logits are its
    only transient); both spread evenly over the fewest chunks their limit allows."""
    N, V = 65536, 163840
    formula = ce.default_chunk_rows(N, V, torch.bfloat16, rows_kernel=False)
    kernel = ce.default_chunk_rows(N, V, torch.bfloat16, rows_kernel=True)
    assert (formula, kernel) == (1599, 3121)  # 41 and 21 chunks: limits 1,638 and 3,276 rows
    assert ce.default_chunk_rows(N, V, torch.float32, rows_kernel=True) == 1599  # fp32 logits: 2^28, 41 chunks
    assert ce.balanced_chunk_rows(37, 8) == 8 and ce.balanced_chunk_rows(10, 1000) == 10
    assert ce.balanced_chunk_rows(0, 8) == 1 and ce.balanced_chunk_rows(13, 1) == 1


def test_chunk_rows_taken_and_override_honoured(monkeypatch):
    h, w, y = _inputs()  # N = 37, V = 50
    h, w = h.float(), w.float()
    sizes = []
    inner = ce._loss_and_logit_grad
    monkeypatch.setattr(ce, "_loss_and_logit_grad", lambda logits, *a: sizes.append(len(logits)) or inner(logits, *a))
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", 50 * 8)  # 8 rows
    monkeypatch.setattr(ce, "CHUNK_BYTES_ROWS_KERNEL", 50 * 32 * 4)  # 32 fp32 rows
    runs = {}
    for rows_kernel in (False, True):
        for chunk_rows in (None, 5):
            sizes.clear()
            runs[rows_kernel, chunk_rows] = chunked_linear_cross_entropy(h, w, y, chunk_rows=chunk_rows,
                                                                         rows_kernel=rows_kernel)
            if chunk_rows == 5:
                assert sizes == [5] * 7 + [2]
            elif rows_kernel and INTERPRETING:
                assert sizes == [19, 18]
            else:  # the torch formula, also where rows_kernel is asked for but cannot run (CPU, no interpreter)
                assert sizes == [8, 8, 8, 8, 5]
    ref = naive_linear_cross_entropy(h, w, y)
    for loss in runs.values():
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())


# ---- the row kernel's launch forms: on a GPU, or in the interpreter ---------------------------------------

test_in_triton_interpreter = rerun_in_interpreter(__file__)


@pytest.fixture
def dev(monkeypatch):
    device = kernel_device()
    monkeypatch.setattr(ce, "_multiprocessors", lambda device: 1)  # programs = programs_per_sm, on a GPU too
    return device


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 7])  # fewer rows than the persistent form's 3 programs, and more
@pytest.mark.parametrize("V", [100, 1000])  # one partial tile; several tiles, the last partial
def test_rows_kernel_equals_torch_formula(dev, form, dtype, rows, V):
    g = torch.Generator().manual_seed(V + rows)
    logits = (torch.randn(rows, V, generator=g) * 3).to(dtype).to(dev)
    labels = torch.randint(0, V, (rows,), generator=g).to(dev)
    labels[0] = -100
    logits[0, 5] = float("inf")  # an ignored row's overflow stays out of the loss and the gradient
    if rows > 3:
        labels[4] = -100
    ref_loss, ref_grad = ce._loss_and_logit_grad(logits.clone(), labels, -100, True, torch.float32, False)
    loss, grad = ce._loss_and_logit_grad_triton(logits.clone(), labels, -100, True, FORMS[form])
    only_loss, none = ce._loss_and_logit_grad_triton(logits.clone(), labels, -100, False, FORMS[form])
    assert none is None and torch.equal(only_loss, loss)
    assert torch.isfinite(loss) and abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert grad.dtype == dtype and grad[0].abs().max() == 0
    step = 2.0 ** -7 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=step, atol=1e-6)


@pytest.mark.parametrize("form", ["per_row", "persistent"])
def test_loss_and_gradients_with_each_form(dev, form, monkeypatch):
    """The whole chunked loss with the row kernel in each form (3 chunks, ignored rows) against the fp64 reference;
    the kernel is checked to be the path taken."""
    monkeypatch.setattr(ce, "LOSS_ROWS", FORMS[form])
    calls = []
    kernel = ce._loss_and_logit_grad_triton
    monkeypatch.setattr(ce, "_loss_and_logit_grad_triton", lambda *a: calls.append(1) or kernel(*a))
    h, w, y = _inputs(N=37, D=16, V=300)
    ref = naive_linear_cross_entropy(h, w, y)
    gh, gw = torch.autograd.grad(ref * 0.37, (h, w))
    ht, wt = h.detach().float().to(dev).requires_grad_(), w.detach().float().to(dev).requires_grad_()
    out = chunked_linear_cross_entropy(ht, wt, y.to(dev), chunk_rows=16, rows_kernel=True)
    th, tw = torch.autograd.grad(out * 0.37, (ht, wt))
    assert len(calls) == 3
    assert abs(out.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert _rel(th.cpu().double(), gh) <= 1e-5 and _rel(tw.cpu().double(), gw) <= 1e-5
    assert th[3].abs().max() == 0 and th[10].abs().max() == 0
