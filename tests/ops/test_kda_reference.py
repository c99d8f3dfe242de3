"""Tests for the KDA references: chunked form vs the token recurrence, varlen, state carry, causality, gate.

Dimensions: B batch, T tokens, H heads, K key dim, V value dim, N documents, C chunk size.
"""

import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda import naive_chunk_kda, naive_kda_gate, naive_recurrent_kda

F64 = torch.float64


def make_inputs(B, T, H, K, V, dtype=F64, seed=0, a_log="zero", dt_bias="normal", N=None):
    """Random KDA inputs with the gate built the way the model builds it; g spans both ends of (−5, 0)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    A_log = torch.zeros(H, dtype=F64) if a_log == "zero" else torch.rand(H, generator=gen, dtype=F64)
    # +4 pushes decays to the lower bound (fast forgetting), −4 to the upper one, N(0, 8²) mixes both.
    bias = 8.0 * randn(H * K) if dt_bias == "normal" else torch.full((H * K,), float(dt_bias), dtype=F64)
    g = naive_kda_gate(randn(B, T, H, K), A_log, bias)
    beta = torch.sigmoid(randn(B, T, H))
    S0 = randn(B if N is None else N, H, K, V)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta, S0))


def tokens(q, k, v, g, beta, sl):
    """The per-token inputs restricted to the positions sl."""
    return tuple(x[:, sl] for x in (q, k, v, g, beta))


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


GATES = [("zero", "+4"), ("zero", "-4"), ("uniform", "normal"), ("zero", "normal")]


@pytest.mark.parametrize("T", [1, 15, 16, 17, 63, 65, 1000])
def test_chunk_matches_recurrent_fp64(T):
    B = 1 if T == 1000 else 2
    for i, (a_log, dt_bias) in enumerate(GATES):
        q, k, v, g, beta, S0 = make_inputs(B, T, 2, 8, 8, seed=i, a_log=a_log, dt_bias=dt_bias)
        for init in (None, S0):
            ref, ref_S = naive_recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True)
            # 1000 tokens: the long run in the kernels' chunk sizes; 1 and 7 take the same steps at the lengths above
            for C in (16, 64) if T == 1000 else (1, 7, 16, 64):
                tri, tri_S = naive_chunk_kda(
                    q, k, v, g, beta, chunk_size=C, initial_state=init, output_final_state=True
                )
                assert (tri - ref).abs().max() <= 1e-10, (a_log, dt_bias, C)
                assert (tri_S - ref_S).abs().max() <= 1e-10, (a_log, dt_bias, C)


def test_chunk_matches_recurrent_wide_heads_fp64():
    q, k, v, g, beta, S0 = make_inputs(2, 70, 3, 32, 16, seed=5, a_log="uniform")
    ref, ref_S = naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=S0, output_final_state=True)
    tri, tri_S = naive_chunk_kda(q, k, v, g, beta, scale=0.3, initial_state=S0, output_final_state=True)
    assert (tri - ref).abs().max() <= 1e-10
    assert (tri_S - ref_S).abs().max() <= 1e-10


def _grads(fn, inputs, cu_seqlens=None, **kw):
    leaves = [x.clone().requires_grad_() for x in inputs]
    q, k, v, g, beta, S0 = leaves
    o, S = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu_seqlens, **kw)
    gen = torch.Generator().manual_seed(1)
    # Random cotangents so that every entry of o and S matters.
    do, dS = (torch.randn(x.shape, generator=gen, dtype=F64) for x in (o, S))
    loss = (o * do).sum() + (S * dS).sum()
    loss.backward()
    return [x.grad for x in leaves]


@pytest.mark.parametrize("C", [16, 64])
def test_gradients_match_fp64(C):
    inputs = make_inputs(2, 37, 2, 8, 6, seed=3, a_log="uniform")
    ref = _grads(naive_recurrent_kda, inputs)
    tri = _grads(naive_chunk_kda, inputs, chunk_size=C)
    for name, r, t in zip(["q", "k", "v", "g", "beta", "initial_state"], ref, tri):
        assert torch.isfinite(r).all() and r.abs().max() > 0, name
        assert (t - r).abs().max() <= 1e-10, name


def test_gradients_match_varlen_fp64():
    cu = torch.tensor([0, 9, 9, 10, 40])
    inputs = make_inputs(1, 40, 2, 8, 6, seed=4, N=4)
    ref = _grads(naive_recurrent_kda, inputs, cu_seqlens=cu)
    tri = _grads(naive_chunk_kda, inputs, cu_seqlens=cu, chunk_size=16)
    for name, r, t in zip(["q", "k", "v", "g", "beta", "initial_state"], ref, tri):
        assert (t - r).abs().max() <= 1e-10, name


@pytest.mark.parametrize("op", [naive_recurrent_kda, naive_chunk_kda])
def test_varlen_equals_separate_calls(op):
    lengths = [5, 0, 1, 37, 20]
    cu = torch.tensor([0] + lengths).cumsum(0)
    T = sum(lengths)
    q, k, v, g, beta, S0 = make_inputs(1, T, 2, 8, 8, seed=6, N=len(lengths))
    kw = {"chunk_size": 16} if op is naive_chunk_kda else {}
    o, S = op(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu, **kw)
    assert o.shape == (1, T, 2, 8) and S.shape == S0.shape
    for n in range(len(lengths)):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        o_n, S_n = op(*tokens(q, k, v, g, beta, sl), initial_state=S0[n : n + 1], output_final_state=True, **kw)
        assert o_n.shape == o[:, sl].shape and torch.allclose(o[:, sl], o_n, rtol=0, atol=1e-12)
        assert (S[n : n + 1] - S_n).abs().max() <= 1e-12
    assert torch.equal(S[1], S0[1])


@pytest.mark.parametrize("op", [naive_recurrent_kda, naive_chunk_kda])
def test_varlen_nan_state_stays_in_its_document(op):
    lengths = [12, 20, 0, 9]
    cu = torch.tensor([0] + lengths).cumsum(0)
    q, k, v, g, beta, S0 = make_inputs(1, sum(lengths), 2, 8, 8, dtype=torch.float32, seed=7, N=len(lengths))
    clean, clean_S = op(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    S0[1] = float("nan")
    o, S = op(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    bad = slice(12, 32)
    assert o[:, bad].isnan().all() and S[1].isnan().all()
    keep = torch.ones(o.shape[1], dtype=torch.bool)
    keep[bad] = False
    assert torch.equal(o[:, keep], clean[:, keep])
    for n in (0, 2, 3):
        assert torch.equal(S[n], clean_S[n])


@pytest.mark.parametrize("op", [naive_recurrent_kda, naive_chunk_kda])
@pytest.mark.parametrize("T1", [1, 16, 23])
def test_split_with_carried_state(op, T1):
    q, k, v, g, beta, S0 = make_inputs(2, 50, 2, 8, 8, seed=8)
    kw = {"chunk_size": 16} if op is naive_chunk_kda else {}
    full, full_S = op(q, k, v, g, beta, initial_state=S0, output_final_state=True, **kw)
    a, b = slice(0, T1), slice(T1, None)
    o1, S1 = op(*tokens(q, k, v, g, beta, a), initial_state=S0, output_final_state=True, **kw)
    o2, S2 = op(*tokens(q, k, v, g, beta, b), initial_state=S1, output_final_state=True, **kw)
    assert (torch.cat((o1, o2), 1) - full).abs().max() <= 1e-12
    assert (S2 - full_S).abs().max() <= 1e-12


def test_token_by_token_decode_equals_prefill():
    q, k, v, g, beta, S0 = make_inputs(2, 20, 2, 8, 8, seed=9)
    full, full_S = naive_chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=16)
    S, outs = S0, []
    for t in range(20):
        step = tokens(q, k, v, g, beta, slice(t, t + 1))
        o_t, S = naive_recurrent_kda(*step, initial_state=S, output_final_state=True)
        outs.append(o_t)
    assert (torch.cat(outs, 1) - full).abs().max() <= 1e-12
    assert (S - full_S).abs().max() <= 1e-12


@pytest.mark.parametrize("op", [naive_recurrent_kda, naive_chunk_kda])
@pytest.mark.parametrize("p", [1, 16, 23])
def test_causality(op, p):
    q, k, v, g, beta, S0 = make_inputs(1, 40, 2, 8, 8, dtype=torch.float32, seed=10)
    kw = {"chunk_size": 16} if op is naive_chunk_kda else {}
    o = op(q, k, v, g, beta, initial_state=S0, **kw)[0]
    q2, k2, v2, g2, beta2, _ = make_inputs(1, 40, 2, 8, 8, dtype=torch.float32, seed=11)
    for x, x2 in ((q, q2), (k, k2), (v, v2), (g, g2), (beta, beta2)):
        x[:, p:] = x2[:, p:]
    o2 = op(q, k, v, g, beta, initial_state=S0, **kw)[0]
    assert torch.equal(o[:, :p], o2[:, :p])
    assert not torch.equal(o[:, p:], o2[:, p:])


@pytest.mark.parametrize("lower_bound", [-5.0, -1.0, -0.1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, F64])
def test_gate_bounded_and_matches_formula(lower_bound, dtype):
    H, K = 3, 4
    gen = torch.Generator().manual_seed(12)
    A_log = torch.rand(H, generator=gen)
    dt_bias = torch.randn(H, K, generator=gen)
    z = torch.randn(5, H, K, generator=gen) * 10
    z[0], z[1] = 1e4, -1e4
    z = z.to(dtype)
    for bias in (None, dt_bias, dt_bias.flatten()):
        g = naive_kda_gate(z, A_log, bias, lower_bound=lower_bound)
        assert g.shape == z.shape and g.dtype == (F64 if dtype == F64 else torch.float32)
        assert torch.isfinite(g).all() and (g >= lower_bound).all() and (g <= 0).all()
        # Huge |z| saturates exactly to the endpoints.
        assert (g[0] == lower_bound).all() and (g[1] == 0).all()
        x = z.double() + (0 if bias is None else bias.double().reshape(H, K))
        expected = lower_bound * torch.sigmoid(A_log.double().exp()[:, None] * x)
        tol = 1e-12 if dtype == F64 else 1e-6
        assert (g.double() - expected).abs().max() <= tol


def test_gate_rejects_bad_shapes():
    z = torch.randn(2, 3, 4)
    with pytest.raises(ValueError):
        naive_kda_gate(z, torch.zeros(4))
    with pytest.raises(ValueError):
        naive_kda_gate(z, torch.zeros(3), torch.zeros(3, 5))


def test_dtypes():
    q, k, v, g, beta, S0 = make_inputs(2, 19, 2, 8, 8, dtype=torch.bfloat16, seed=13)
    for op in (naive_recurrent_kda, naive_chunk_kda):
        o, S = op(q, k, v, g, beta, initial_state=S0, output_final_state=True)
        assert o.dtype == torch.bfloat16 and S.dtype == torch.float32 and S.shape == (2, 2, 8, 8)
        assert op(q, k, v, g, beta)[1] is None


def test_fp32_chunk_close_to_fp64_recurrent():
    inputs = make_inputs(2, 256, 2, 32, 32, seed=14, a_log="uniform")
    ref, ref_S = naive_recurrent_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    f32 = [x.float() for x in inputs]
    for C in (16, 64):
        tri, tri_S = naive_chunk_kda(*f32[:5], initial_state=f32[5], output_final_state=True, chunk_size=C)
        assert tri.dtype == torch.float32
        # Observed ≈ 1e-7; the bound leaves room for other BLAS builds.
        assert rel_err(tri, ref) <= 1e-5
        assert rel_err(tri_S, ref_S) <= 1e-5


def _bad_calls():
    q, k, v, g, beta, S0 = make_inputs(1, 10, 2, 8, 8, N=2)
    q2, k2, v2, g2, beta2, _ = make_inputs(2, 10, 2, 8, 8)
    cu = torch.tensor([0, 4, 10])
    return {
        "varlen_batch_2": ((q2, k2, v2, g2, beta2), dict(cu_seqlens=cu)),
        "offsets_not_from_0": ((q, k, v, g, beta), dict(cu_seqlens=torch.tensor([1, 4, 10]))),
        "offsets_not_to_T": ((q, k, v, g, beta), dict(cu_seqlens=torch.tensor([0, 4, 9]))),
        "offsets_decreasing": ((q, k, v, g, beta), dict(cu_seqlens=torch.tensor([0, 6, 4, 10]))),
        "offsets_float": ((q, k, v, g, beta), dict(cu_seqlens=cu.double())),
        "offsets_2d": ((q, k, v, g, beta), dict(cu_seqlens=cu[None])),
        "state_wrong_N": ((q, k, v, g, beta), dict(cu_seqlens=cu, initial_state=S0[:1])),
        "state_wrong_batch": ((q2, k2, v2, g2, beta2), dict(initial_state=S0[:1])),
        "k_shape": ((q, k[..., :4], v, g, beta), {}),
        "g_shape": ((q, k, v, g[:, :5], beta), {}),
        "v_shape": ((q, k, v[:, :5], g, beta), {}),
        "beta_shape": ((q, k, v, g, beta[..., None]), {}),
        "q_3d": ((q[0], k, v, g, beta), {}),
    }


@pytest.mark.parametrize("op", [naive_recurrent_kda, naive_chunk_kda])
@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_raises(op, case):
    args, kw = _bad_calls()[case]
    with pytest.raises(ValueError):
        op(*args, **kw)


def test_bad_chunk_size_raises():
    q, k, v, g, beta, _ = make_inputs(1, 10, 2, 8, 8)
    with pytest.raises(ValueError):
        naive_chunk_kda(q, k, v, g, beta, chunk_size=0)
