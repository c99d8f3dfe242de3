"""MLA training/prefill attention backends (k3.ops.attention) against the reference `attend`.

On CPU: SDPA forward and gradients, flex_attention forward (PyTorch has no flex backward on CPU), and the
FlashAttention varlen plumbing with a stand-in kernel (flash_attn is not installed here). The CUDA runs,
gradients of flex included, are in tests/gpu/test_fast_paths.py.

Legend: B batch, T tokens, S keys, H heads.
"""

import pytest
import torch
import torch.nn.functional as F

import k3.ops.attention as attention_ops
from k3.config import get_preset
from k3.model.cache import MLALatent
from k3.model.mla import GatedMLA
from k3.model.sequence import SequenceLayout
from k3.ops.attention import document_mask, max_logits_chunked, resolve_backend

CONFIG = get_preset("debug")


def make_mla(seed=0, dtype=torch.float64, std=0.1, backend="reference"):
    torch.manual_seed(seed)
    mla = GatedMLA(CONFIG.replace(attention_backend=backend), layer_idx=3)
    with torch.no_grad():
        for name, p in mla.named_parameters():
            p.copy_(1 + std * torch.randn_like(p)) if "layernorm" in name else p.normal_(0.0, std)
    return mla.to(dtype)


def rand_x(B, T, seed, dtype=torch.float64):
    return torch.randn(B, T, CONFIG.hidden_size, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def packed(B, T, cu):
    return SequenceLayout.build(B, T, torch.tensor(cu), "cpu")


def queries(mla, x):
    B, T, _ = x.shape
    return mla.q_b_proj(mla.q_a_layernorm(mla.q_a_proj(x))).view(B, T, mla.num_heads, -1)


def test_resolve_backend():
    assert resolve_backend("auto", torch.device("cpu")) == "reference"
    assert resolve_backend("sdpa", torch.device("cpu")) == "sdpa"
    with pytest.raises(ValueError):
        resolve_backend("cudnn", torch.device("cpu"))
    with pytest.raises(ValueError):
        CONFIG.replace(attention_backend="cudnn")
    if attention_ops.flash_attn_varlen_func is None:
        with pytest.raises(ValueError):
            resolve_backend("flash", torch.device("cpu"))


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_packed_forward_and_max_logits_equal_reference(backend):
    """Two rows of packed documents (one document of one token): outputs fp64 ≤ 1e-10, max logits ≤ 1e-6."""
    ref, fast = make_mla(seed=1), make_mla(seed=1, backend=backend)
    B, T = 2, 12
    x = rand_x(B, T, seed=2)
    x[:, 4] *= 30.0  # a large logit that the document mask must hide from other documents
    layout = packed(B, T, [0, 5, 6, 12, 15, 24])
    with torch.no_grad():
        ml_ref, ml_fast = [], []
        y_ref, _ = ref(x, layout, max_logits=ml_ref)
        y_fast, _ = fast(x, layout, max_logits=ml_fast)
    torch.testing.assert_close(y_fast, y_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(ml_fast[0], ml_ref[0], atol=1e-6, rtol=1e-6)
    assert ml_fast[0].shape == (CONFIG.num_attention_heads,) and ml_fast[0].dtype == torch.float32


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_prefill_after_cache_prefix(backend):
    """A chunk of T tokens after a cached prefix (offset = prefix length) equals the reference."""
    ref, fast = make_mla(seed=3), make_mla(seed=3, backend=backend)
    B, P, T = 2, 5, 7
    state = MLALatent(ref.latent(rand_x(B, P, seed=4)))
    x = rand_x(B, T, seed=5)
    with torch.no_grad():
        y_ref, s_ref = ref(x, SequenceLayout(B, T), state=state, use_cache=True)
        y_fast, s_fast = fast(x, SequenceLayout(B, T), state=state, use_cache=True)
    torch.testing.assert_close(y_fast, y_ref, atol=1e-10, rtol=0)
    assert torch.equal(s_fast.latent, s_ref.latent)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex"])
def test_context_parallel_seam(backend):
    """Queries of positions [5, 9) against the whole 12-token latent (its future keys included) with their
    own document ids equal rows 5..8 of the full packed forward: what a CP rank with a gathered latent runs."""
    mla = make_mla(seed=6)
    T = 12
    x = rand_x(1, T, seed=7)
    layout = packed(1, T, [0, 3, 7, 12])
    seg = layout.segment_ids
    with torch.no_grad():
        q, latent = queries(mla, x), mla.latent(x)
        full = mla.attention(q, latent, 0, seg, seg, backend="reference")
        part_ml = []
        part = mla.attention(q[:, 5:9], latent, 5, seg[:, 5:9], seg, part_ml, backend=backend)
    torch.testing.assert_close(part.double(), full[:, 5:9].double(), atol=1e-10, rtol=0)
    with torch.no_grad():
        scores = torch.einsum("bthd,bshd->bhts", q[:, 5:9], mla.expand_latent(latent)[0]) * mla.softmax_scale
    visible = document_mask(4, T, 5, seg[:, 5:9], seg, "cpu")
    expected = scores.masked_fill(~visible[:, None], float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(part_ml[0], expected.float(), atol=1e-6, rtol=1e-6)


def test_sdpa_gradients_equal_reference():
    """Every parameter and input gradient through the SDPA backend: fp64 ≤ 1e-10."""
    ref, fast = make_mla(seed=8), make_mla(seed=8, backend="sdpa")
    B, T = 2, 10
    layout = packed(B, T, [0, 4, 10, 13, 20])
    xr = rand_x(B, T, seed=9).requires_grad_()
    xf = xr.detach().clone().requires_grad_()
    ref(xr, layout)[0].pow(2).sum().backward()
    fast(xf, layout)[0].pow(2).sum().backward()
    torch.testing.assert_close(xf.grad, xr.grad, atol=1e-10, rtol=0)
    for (name, a), b in zip(fast.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=0, msg=name)


def test_flash_varlen_plumbing(monkeypatch):
    """The flash backend's cu_seqlens, value padding and reshapes, with a stand-in varlen kernel."""
    calls = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] and causal and torch.equal(cu_q, cu_k)
        calls.append((cu_q.tolist(), max_q))
        out = torch.empty_like(v)
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                               v[a:b].transpose(0, 1), is_causal=True, scale=softmax_scale)
            out[a:b] = o.transpose(0, 1)
        return out

    monkeypatch.setattr(attention_ops, "flash_attn_varlen_func", fake_varlen)
    ref, fast = make_mla(seed=10), make_mla(seed=10, backend="flash")
    B, T = 2, 9
    x = rand_x(B, T, seed=11)
    layout = packed(B, T, [0, 2, 9, 12, 18])
    with torch.no_grad():
        ml = []
        y_fast, _ = fast(x, layout, max_logits=ml)
        y_ref, _ = ref(x, layout)
    assert calls == [([0, 2, 9, 12, 18], 7)]
    torch.testing.assert_close(y_fast, y_ref, atol=1e-10, rtol=0)
    with torch.no_grad():
        fast(x, SequenceLayout(B, T))  # unpacked rows are one document each
    assert calls[-1] == ([0, 9, 18], 9)


def test_max_logits_chunked_matches_dense():
    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 9, 3, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 11, 3, 8, generator=g, dtype=torch.float64)
    doc_q = torch.tensor([[0] * 4 + [1] * 5, [2] * 9])
    doc_k = torch.tensor([[0] * 5 + [1] * 6, [2] * 11])
    dense = (torch.einsum("bthd,bshd->bhts", q, k) * 0.5).masked_fill(
        ~document_mask(9, 11, 2, doc_q, doc_k, "cpu")[:, None], float("-inf")).amax(dim=(0, 2, 3))
    for budget in (1, 50, 1 << 20):  # query chunks of 1 row, a few rows, all rows
        torch.testing.assert_close(max_logits_chunked(q, k, 0.5, 2, doc_q, doc_k, budget), dense.float())
