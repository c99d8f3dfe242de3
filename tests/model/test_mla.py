"""Gated MLA with NoPE (docs/architecture.md §3, tests §3.4): naive (expanded) vs absorbed, prefill + decode,
the latent cache, SDPA parity, packed documents, QK-Clip max logits, causality.

Legend: B batch, T tokens, H heads, N nope dim, R rope dim (never rotated), Vd value dim, C kv_lora_rank.
"""

import pytest
import torch
import torch.nn.functional as F

from k3.config import get_preset
from k3.model.cache import MLALatent
from k3.model.mla import GatedMLA
from k3.model.sequence import SequenceLayout

CONFIG = get_preset("debug")
H = CONFIG.num_attention_heads
N, R, VD = CONFIG.qk_nope_head_dim, CONFIG.qk_rope_head_dim, CONFIG.v_head_dim
C = CONFIG.kv_lora_rank
EPS = CONFIG.rms_norm_eps


def make_mla(seed: int = 0, dtype=torch.float64, std: float = 0.1) -> GatedMLA:
    """GatedMLA at debug size, weights N(0, std) and norm gains 1 + N(0, std): attention is far from uniform."""
    torch.manual_seed(seed)
    mla = GatedMLA(CONFIG, layer_idx=3)
    with torch.no_grad():
        for name, p in mla.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + std * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    return mla.to(dtype)


def rand_x(B: int, T: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, CONFIG.hidden_size, generator=g, dtype=dtype)


def plain(B: int, T: int) -> SequenceLayout:
    return SequenceLayout(B, T)


def rms(x, w):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def expand(mla: GatedMLA, x: torch.Tensor):
    """§3.2 from the module's weights, written independently: q, k [B, H, T, N+R], v [B, H, T, Vd]."""
    B, T, _ = x.shape
    q = rms(x @ mla.q_a_proj.weight.t(), mla.q_a_layernorm.weight) @ mla.q_b_proj.weight.t()
    q = q.view(B, T, H, N + R).transpose(1, 2)
    kv_a = x @ mla.kv_a_proj_with_mqa.weight.t()
    c, k_pe = kv_a[..., :C], kv_a[..., C:]
    kv = (rms(c, mla.kv_a_layernorm.weight) @ mla.kv_b_proj.weight.t()).view(B, T, H, N + VD).transpose(1, 2)
    k_nope, v = kv[..., :N], kv[..., N:]
    # NoPE: k_pe is shared by all heads and never rotated
    k = torch.cat([k_nope, k_pe[:, None].expand(B, H, T, R)], dim=-1)
    return q, k, v


def gate_and_project(mla: GatedMLA, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """o [B, H, T, Vd] -> y = o_proj(σ(g_proj x) ⊙ concat_h o_h)."""
    B, _, T, _ = o.shape
    o = o.transpose(1, 2).reshape(B, T, H * VD)
    return (torch.sigmoid(x @ mla.g_proj.weight.t()) * o) @ mla.o_proj.weight.t()


def test_scale_is_192_analogue():
    mla = make_mla()
    assert mla.softmax_scale == (CONFIG.qk_head_dim) ** -0.5 == (N + R) ** -0.5


@pytest.mark.parametrize("prefix", [0, 5])
@pytest.mark.parametrize("T", [1, 7])
def test_absorbed_equals_naive_fp64(prefix, T):
    mla = make_mla(seed=1)
    B = 2
    x = rand_x(B, T, seed=2)
    state = MLALatent(mla.latent(rand_x(B, prefix, seed=3))) if prefix else None
    naive, _ = mla(x, plain(B, T), state=state, impl="naive")
    absorb, _ = mla(x, plain(B, T), state=state, impl="absorb")
    assert naive.dtype == torch.float64
    # the attention is not near-uniform (the test would see a wrong W_UK / W_UV fold)
    assert naive.abs().max() > 1e-3
    # fp64, same math regrouped: ≤ 1e-10 (observed ~1e-16)
    torch.testing.assert_close(absorb, naive, atol=1e-10, rtol=0)
    auto, _ = mla(x, plain(B, T), state=state)
    assert torch.equal(auto, absorb if T == 1 else naive)


def test_unknown_impl_raises():
    mla = make_mla()
    with pytest.raises(ValueError):
        mla(rand_x(1, 3, seed=0), plain(1, 3), impl="flash")


@pytest.mark.parametrize("impl", ["auto", "naive", "absorb"])
def test_prefill_then_decode_equals_full_forward(impl):
    mla = make_mla(seed=4)
    B, T, T1 = 2, 11, 4
    x = rand_x(B, T, seed=5)
    full, none = mla(x, plain(B, T), impl=impl)
    assert none is None
    outs = []
    y, state = mla(x[:, :T1], plain(B, T1), use_cache=True, impl=impl)
    outs.append(y)
    # one multi-token chunk, then token-by-token decode
    y, state = mla(x[:, T1 : T1 + 3], plain(B, 3), state=state, use_cache=True, impl=impl)
    outs.append(y)
    for t in range(T1 + 3, T):
        y, state = mla(x[:, t : t + 1], plain(B, 1), state=state, use_cache=True, impl=impl)
        outs.append(y)
    # fp64: ≤ 1e-10
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-10, rtol=0)
    assert state.latent.shape == (B, T, C + R)


def test_cache_holds_post_norm_latent_only():
    mla = make_mla(seed=6)
    B, T1 = 2, 6
    x = rand_x(B, T1 + 2, seed=7)
    _, state = mla(x[:, :T1], plain(B, T1), use_cache=True)
    # exactly kv_lora_rank + qk_rope_head_dim values per token (576 at K3 size), nothing per head
    assert isinstance(state, MLALatent)
    assert state.latent.shape == (B, T1, C + R) == (B, T1, 96)
    assert torch.equal(state.latent, mla.latent(x[:, :T1]))
    # post-norm: [RMSNorm(c; kv_a_layernorm) ; raw k_pe]
    kv_a = x[:, :T1] @ mla.kv_a_proj_with_mqa.weight.t()
    torch.testing.assert_close(state.latent[..., :C], rms(kv_a[..., :C], mla.kv_a_layernorm.weight),
                               atol=1e-13, rtol=0)
    torch.testing.assert_close(state.latent[..., C:], kv_a[..., C:], atol=1e-13, rtol=0)
    # decoding grows it by one row per token: the new token's latent, earlier rows untouched
    prev = state.latent.clone()
    _, state = mla(x[:, T1 : T1 + 1], plain(B, 1), state=state, use_cache=True)
    assert state.latent.shape == (B, T1 + 1, C + R)
    assert torch.equal(state.latent[:, :T1], prev)
    # fp64, one row vs a batch of rows through the same Linear: ≤ 1e-13
    torch.testing.assert_close(state.latent[:, T1:], mla.latent(x[:, T1 : T1 + 1]), atol=1e-13, rtol=0)


def test_expanded_transcription_matches_module():
    """The test's own expansion (used below for SDPA) is the module's naive path."""
    mla = make_mla(seed=8)
    B, T = 2, 9
    x = rand_x(B, T, seed=9)
    q, k, v = expand(mla, x)
    scores = (q @ k.transpose(-1, -2)) * (N + R) ** -0.5
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    ref = gate_and_project(mla, x, probs @ v)
    y, _ = mla(x, plain(B, T), impl="naive")
    # fp64: ≤ 1e-12
    torch.testing.assert_close(y, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_sdpa_with_explicit_scale_matches(dtype, tol):
    """SDPA (is_causal, scale = qk_head_dim^-1/2, value dim ≠ qk dim) on the expanded q/k/v.

    Tolerance: fp64 ≤ 1e-12; fp32 ≤ 2e-5 absolute on outputs of size ~1e-1.
    """
    mla = make_mla(seed=10, dtype=dtype)
    B, T = 2, 13
    x = rand_x(B, T, seed=11, dtype=dtype)
    q, k, v = expand(mla, x)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=CONFIG.qk_head_dim ** -0.5)
    ref = gate_and_project(mla, x, o)
    for impl in ("naive", "absorb"):
        y, _ = mla(x, plain(B, T), impl=impl)
        torch.testing.assert_close(y, ref, atol=tol, rtol=tol)
    # the default scale (1/sqrt(qk_head_dim)) coincides here; a wrong scale would not
    o_wrong = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=N ** -0.5)
    assert (gate_and_project(mla, x, o_wrong) - ref).abs().max() > 100 * tol


@pytest.mark.parametrize("impl", ["naive", "absorb"])
def test_packed_documents_equal_separate_runs(impl):
    mla = make_mla(seed=12)
    lengths = [5, 8]
    T = sum(lengths)
    x = rand_x(1, T, seed=13)
    layout = SequenceLayout.build(1, T, torch.tensor([0, 5, 13]), "cpu")
    packed, _ = mla(x, layout, impl=impl)
    separate = torch.cat([mla(x[:, :5], plain(1, 5), impl=impl)[0],
                          mla(x[:, 5:], plain(1, 8), impl=impl)[0]], dim=1)
    # fp64: ≤ 1e-12
    torch.testing.assert_close(packed, separate, atol=1e-12, rtol=0)
    # and the packed result differs from treating the row as one document
    joined, _ = mla(x, plain(1, T), impl=impl)
    assert (joined[:, 5:] - packed[:, 5:]).abs().max() > 1e-6


def test_packed_two_rows():
    mla = make_mla(seed=14)
    B, T = 2, 8
    x = rand_x(B, T, seed=15)
    # row 0 = docs [0, 3) and [3, 8); row 1 = docs [8, 10) and [10, 16)
    layout = SequenceLayout.build(B, T, torch.tensor([0, 3, 8, 10, 16]), "cpu")
    packed, _ = mla(x, layout)
    flat = x.view(1, B * T, -1)
    parts = [mla(flat[:, s:e], plain(1, e - s))[0] for s, e in [(0, 3), (3, 8), (8, 10), (10, 16)]]
    torch.testing.assert_close(packed.view(1, B * T, -1), torch.cat(parts, dim=1), atol=1e-12, rtol=0)
    with pytest.raises(ValueError):
        mla(x, layout, use_cache=True)


@torch.no_grad()
def manual_scores(mla: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    q, k, _ = expand(mla, x)
    return (q @ k.transpose(-1, -2)) * (N + R) ** -0.5  # [B, H, T, T], every pair, no mask


@pytest.mark.parametrize("impl", ["naive", "absorb"])
def test_max_logits_over_unmasked_pairs_only(impl):
    mla = make_mla(seed=16)
    B, T = 2, 10
    x = rand_x(B, T, seed=17)
    # a huge k_pe at the last position: its logits against earlier queries are masked (future key)
    x[:, -1] *= 50.0
    scores = manual_scores(mla, x)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    expected = scores.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))  # [H]
    unmasked_all = scores.amax(dim=(0, 2, 3))
    # some head has its largest logit at a masked pair: counting masked pairs would be visible
    assert (unmasked_all > expected + 1.0).any()
    got = []
    mla(x, plain(B, T), impl=impl, max_logits=got)
    assert len(got) == 1 and got[0].shape == (H,) and got[0].dtype == torch.float32
    # fp64 logits reported in fp32: ≤ 1e-6 relative
    torch.testing.assert_close(got[0], expected.float(), atol=1e-6, rtol=1e-6)


def test_max_logits_respect_document_mask():
    mla = make_mla(seed=18)
    T = 12
    x = rand_x(1, T, seed=19)
    # huge k_pe at the end of document 0: document 1's queries may not count it
    x[:, 5] *= 50.0
    layout = SequenceLayout.build(1, T, torch.tensor([0, 6, 12]), "cpu")
    scores = manual_scores(mla, x)
    seg = torch.tensor([0] * 6 + [1] * 6)
    allowed = torch.ones(T, T, dtype=torch.bool).tril() & (seg[:, None] == seg[None, :])
    expected = scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))
    causal_only = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).amax(dim=(0, 2, 3))
    assert (causal_only > expected + 1.0).any()
    got = []
    mla(x, layout, max_logits=got)
    torch.testing.assert_close(got[0], expected.float(), atol=1e-6, rtol=1e-6)


def test_max_logits_with_cache_prefix():
    mla = make_mla(seed=20)
    B, P, T = 1, 4, 3
    xp, x = rand_x(B, P, seed=21), rand_x(B, T, seed=22)
    state = MLALatent(mla.latent(xp))
    scores = manual_scores(mla, torch.cat([xp, x], dim=1))[:, :, P:]  # queries of the new tokens only
    allowed = torch.ones(P + T, P + T, dtype=torch.bool).tril()[P:]
    expected = scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))
    for impl in ("naive", "absorb"):
        got = []
        mla(x, plain(B, T), state=state, impl=impl, max_logits=got)
        torch.testing.assert_close(got[0], expected.float(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("impl", ["naive", "absorb"])
def test_causality_bit_identical_prefix(dtype, impl):
    mla = make_mla(seed=23, dtype=dtype)
    B, T, p = 2, 12, 5
    x = rand_x(B, T, seed=24, dtype=dtype)
    base, _ = mla(x, plain(B, T), impl=impl)
    x2 = x.clone()
    x2[:, p:] = rand_x(B, T - p, seed=25, dtype=dtype) * 10
    moved, _ = mla(x2, plain(B, T), impl=impl)
    assert torch.equal(moved[:, :p], base[:, :p])
    assert not torch.equal(moved[:, p:], base[:, p:])


def test_bf16_output_dtype_and_fp32_scores():
    """bf16 module: scores/softmax in fp32, one cast at the end; close to the fp64 result."""
    ref_mla = make_mla(seed=26)
    mla = make_mla(seed=26, dtype=torch.bfloat16)
    x = rand_x(1, 6, seed=27)
    y, _ = mla(x.bfloat16(), plain(1, 6))
    assert y.dtype == torch.bfloat16
    ml = []
    mla(x.bfloat16(), plain(1, 6), max_logits=ml)
    assert ml[0].dtype == torch.float32
    ref, _ = ref_mla(x, plain(1, 6))
    # bf16 weights and activations (8 mantissa bits) through ~5 matmuls: ≤ 5% of the output scale
    assert (y.double() - ref).abs().max() <= 0.05 * ref.abs().max()


@pytest.mark.parametrize("impl", ["naive", "absorb"])
def test_attend_documents_equals_masked_reference(impl):
    """The per-document path of packed rows against `attend` with the full block-diagonal mask: outputs, max
    logits and the gradients of q and the latent, fp64 to 1e-12 (a zero-length document included)."""
    from k3.model.mla import attention_mask

    mla = make_mla(seed=30)
    B, T = 2, 12
    offsets = [0, 3, 3, 12, 17, 24]  # row 0: docs of 3, 0 and 9 tokens; row 1: 5 and 7
    layout = SequenceLayout.build(B, T, torch.tensor(offsets), "cpu")
    g = torch.Generator().manual_seed(31)
    q = torch.randn(B, T, H, N + R, generator=g, dtype=torch.float64, requires_grad=True)
    latent = torch.randn(B, T, C + R, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(B, T, H, VD, generator=g, dtype=torch.float64)
    results = []
    for fast in (True, False):
        logits = []
        if fast:
            o = mla.attend_documents(q, latent, offsets, impl, logits)
        else:
            o = mla.attend(q, latent, attention_mask(layout, T, 0, "cpu"), impl, logits)
        dq, dlatent = torch.autograd.grad((o * weight).sum(), (q, latent))
        results.append((o, logits[0], dq, dlatent))
    for fast, ref in zip(*results):
        torch.testing.assert_close(fast, ref, atol=1e-12, rtol=0)
