"""MLA's per-head keys and values (`k3.ops.mla_keys`): the Triton pair against the torch cat, forward and backward,
on a GPU or in the Triton interpreter (a subprocess on CPU).

Legend: R rows, H heads, N nope dim, P shared key dim, Vd value dim.
"""

import pytest
import torch

from k3.ops.mla_keys import expand_keys, naive_expand_keys
from tests.interpreter import kernel_device, rerun_in_interpreter

test_in_triton_interpreter = rerun_in_interpreter(__file__)


@pytest.fixture
def dev():
    return kernel_device()


def _inputs(lead, H, N, P, Vd, C, dtype, pe_dtype, dev, seed):
    """kv as the GEMM's view [*lead, H, N + Vd]; k_pe as the latent's column slice [*lead, P] (row stride C + P)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(*lead, H * (N + Vd), generator=g).to(dtype).to(dev).view(*lead, H, N + Vd)
    latent = torch.randn(*lead, C + P, generator=g).to(pe_dtype).to(dev)
    return kv, latent[..., C:]


@pytest.mark.parametrize("lead,H,N,P,Vd", [((2, 37), 3, 8, 4, 16), ((1, 70), 2, 6, 5, 12), ((130,), 8, 16, 16, 32)],
                         ids=["pow2-dims", "odd-dims", "one-lead-dim"])
@pytest.mark.parametrize("dtype,pe_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16-fp32-latent"])
def test_matches_the_cat(dev, lead, H, N, P, Vd, dtype, pe_dtype):
    """Forward: pure copies and one cast, so bit for bit (every element written: torch.empty outputs). Backward:
    d(kv) bit for bit; dk_pe, a sum over heads, against the fp64 sum within 1e-6 relative in fp32 (the kernel sums
    in fp32) and one bf16 rounding in bf16."""
    kv, k_pe = _inputs(lead, H, N, P, Vd, 7, dtype, pe_dtype, dev, seed=H * 100 + N)
    k_ref, v_ref = naive_expand_keys(kv, k_pe, N)
    kv_t, pe_t = kv.clone().requires_grad_(), k_pe.clone().requires_grad_()
    k, v = expand_keys(kv_t, pe_t, N)
    assert k.shape == (*lead, H, N + P) and v.shape == (*lead, H, Vd) and k.is_contiguous() and v.is_contiguous()
    assert k.dtype == dtype and torch.equal(k, k_ref) and torch.equal(v, v_ref)

    g = torch.Generator().manual_seed(1)
    dk = torch.randn(k.shape, generator=g).to(dtype).to(dev)
    dv = torch.randn(v.shape, generator=g).to(dtype).to(dev)
    dkv, dpe = torch.autograd.grad((k, v), (kv_t, pe_t), (dk, dv))
    assert dkv.dtype == dtype and dpe.dtype == pe_dtype
    assert torch.equal(dkv, torch.cat([dk[..., :N], dv], dim=-1))
    dpe_ref = dk[..., N:].double().sum(-2)
    tol = 1e-6 if dtype == torch.float32 and pe_dtype == torch.float32 else 8e-3
    torch.testing.assert_close(dpe.double(), dpe_ref, rtol=tol, atol=tol * dpe_ref.abs().max().item())


def test_one_gradient_missing(dev):
    """Only k used (v's gradient None): d(kv)'s value columns are zeros."""
    kv, k_pe = _inputs((5,), 2, 4, 4, 8, 3, torch.float32, torch.float32, dev, seed=3)
    kv.requires_grad_()
    k, v = expand_keys(kv, k_pe, 4)
    (dkv,) = torch.autograd.grad(k.sum(), kv)
    assert torch.equal(dkv[..., 4:], torch.zeros_like(dkv[..., 4:])) and torch.equal(dkv[..., :4], torch.ones_like(
        dkv[..., :4]))


def test_errors(dev):
    kv, k_pe = _inputs((5,), 2, 4, 4, 8, 3, torch.float32, torch.float32, dev, seed=4)
    with pytest.raises(ValueError, match="leading dims"):
        expand_keys(kv, k_pe[:4], 4)
    with pytest.raises(ValueError, match="nope_dim"):
        expand_keys(kv, k_pe, 12)
