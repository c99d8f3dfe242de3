"""The fused SiTU-GLU autograd Function and the gated RMSNorm, on CPU (the Triton kernels themselves run
in test_triton_interpreter.py and, at full shapes, in tests/gpu)."""

import torch

from k3.model.norm import RMSNorm, gated_rms_norm, rms_norm
from k3.ops.situ import (naive_situ_glu, situ_glu, situ_glu_backward, weighted_situ_glu_backward,
                         weighted_situ_glu_forward)


def test_situ_glu_function_equals_reference_fp64():
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(6, 9, generator=g, dtype=torch.float64) * 6).requires_grad_()
    up = (torch.randn(6, 9, generator=g, dtype=torch.float64) * 40).requires_grad_()
    out = situ_glu(gate, up)
    ref = naive_situ_glu(gate, up)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    df = torch.randn(out.shape, generator=g, dtype=torch.float64)
    a = torch.autograd.grad(out, (gate, up), df)
    b = torch.autograd.grad(ref, (gate, up), df)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12)  # closed form vs autograd
    assert torch.autograd.gradcheck(situ_glu, (gate, up))


def test_situ_backward_into_halves_of_one_buffer():
    """The MoE path writes dg and du into the two halves of one [M, 2I] buffer (no concatenation)."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 8, generator=g, dtype=torch.float64) * 5
    df = torch.randn(5, 4, generator=g, dtype=torch.float64)
    out = torch.empty_like(h)
    dg, du = situ_glu_backward(h[:, :4], h[:, 4:], df, 4.0, 25.0, out=out)
    torch.testing.assert_close(out, torch.cat([dg, du], dim=1), atol=0, rtol=0)


def test_weighted_situ_glu_equals_autograd_fp64():
    """The MoE's row-weighted SiTU-GLU a = p ⊙ f(g, u) without autograd: forward, [dg | du] into one buffer,
    the weighted activation and dp = Σ da ⊙ f against autograd of the reference (fp64, ≤ 1e-12)."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(7, 10, generator=g, dtype=torch.float64) * torch.tensor([6.0] * 5 + [40.0] * 5, dtype=torch.float64)
    p = torch.rand(7, generator=g, dtype=torch.float64)
    gate, up, pr = (t.clone().requires_grad_() for t in (h[:, :5], h[:, 5:], p))
    ref = naive_situ_glu(gate, up) * pr[:, None]
    da = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(da)
    torch.testing.assert_close(weighted_situ_glu_forward(h[:, :5], h[:, 5:], p, 4.0, 25.0), ref.detach(),
                               atol=1e-12, rtol=1e-12)
    out = torch.empty_like(h)
    wact, dp = weighted_situ_glu_backward(h[:, :5], h[:, 5:], da, p, 4.0, 25.0, out=out)
    for got, want in ((out[:, :5], gate.grad), (out[:, 5:], up.grad), (wact, ref.detach()), (dp, pr.grad)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_gated_rms_norm_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 16, generator=g, dtype=torch.float64)
    gate = torch.randn(3, 4, 16, generator=g, dtype=torch.float64)
    norm = RMSNorm(16).double()
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1, generator=g)
    expected = rms_norm(x, norm.weight, 1e-5) * torch.sigmoid(gate)
    torch.testing.assert_close(gated_rms_norm(x, norm.weight, gate, 1e-5), expected, atol=1e-15, rtol=0)
    torch.testing.assert_close(norm.gated(x, gate), expected, atol=1e-15, rtol=0)
    # the gated output takes the gate's dtype (KDA's output-gate activation dtype)
    assert gated_rms_norm(x.float(), norm.weight.float(), gate.bfloat16(), 1e-5).dtype == torch.bfloat16


def test_rms_norm_out_dtype_reference():
    """The reference norm written in another dtype is the norm rounded once; a gated norm keeps the gate's."""
    x = torch.randn(4, 9, 32, dtype=torch.float64)
    norm = RMSNorm(32).double()
    out = norm(x.float(), out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, norm(x.float()).to(torch.bfloat16), atol=0, rtol=0)
