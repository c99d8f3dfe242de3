"""torch_chunk_kda (factorised decays, the CPU fast path) against the naive references."""

import pytest
import torch

from k3.ops.kda import naive_kda_gate, naive_recurrent_kda, torch_chunk_kda
from tests.ops.test_kda_reference import GATES, make_inputs, rel_err


@pytest.mark.parametrize("T", [1, 15, 16, 17, 65, 300])
def test_matches_recurrent_fp64(T):
    for i, (a_log, dt_bias) in enumerate(GATES):
        q, k, v, g, beta, S0 = make_inputs(2, T, 2, 8, 8, seed=i, a_log=a_log, dt_bias=dt_bias)
        for init in (None, S0):
            ref, ref_S = naive_recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True)
            for C in (1, 5, 16):
                tri, tri_S = torch_chunk_kda(q, k, v, g, beta, chunk_size=C, initial_state=init,
                                             output_final_state=True)
                assert (tri - ref).abs().max() <= 1e-10, (a_log, dt_bias, C)
                assert (tri_S - ref_S).abs().max() <= 1e-10, (a_log, dt_bias, C)


def test_gradients_match_recurrent_fp64():
    inputs = make_inputs(1, 37, 2, 8, 8, seed=3)
    ref_in = [x.clone().requires_grad_() for x in inputs]
    tri_in = [x.clone().requires_grad_() for x in inputs]
    ref, ref_S = naive_recurrent_kda(*ref_in[:5], initial_state=ref_in[5], output_final_state=True)
    tri, tri_S = torch_chunk_kda(*tri_in[:5], initial_state=tri_in[5], output_final_state=True)
    w_o, w_s = torch.randn_like(ref), torch.randn_like(ref_S)
    ((ref * w_o).sum() + (ref_S * w_s).sum()).backward()
    ((tri * w_o).sum() + (tri_S * w_s).sum()).backward()
    for name, a, b in zip("q k v g beta S0".split(), tri_in, ref_in):
        assert (a.grad - b.grad).abs().max() <= 1e-10, name


def test_fp32_at_the_gate_lower_bound():
    """Every decay at g_min = −5: the factorised exponents reach their largest magnitude (e^±75 at C = 16).
    fp32 output vs the fp64 recurrence: relative error ≤ 1e-5 (observed ~1e-7)."""
    q, k, v, _, beta, S0 = make_inputs(2, 128, 2, 32, 32, seed=4)
    g = torch.full_like(q, -5.0 + 1e-6)
    ref, ref_S = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    tri, tri_S = torch_chunk_kda(*(x.float() for x in (q, k, v, g, beta)), initial_state=S0.float(),
                                 output_final_state=True)
    assert torch.isfinite(tri).all() and torch.isfinite(tri_S).all()
    assert rel_err(tri, ref) <= 1e-5 and rel_err(tri_S, ref_S) <= 1e-5


def test_varlen_matches_separate_calls():
    lengths = [5, 0, 1, 37, 20]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    q, k, v, g, beta, _ = make_inputs(1, sum(lengths), 2, 8, 8, seed=5)
    S0 = torch.randn(len(lengths), 2, 8, 8, dtype=torch.float64)
    packed, packed_S = torch_chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(a, b)
        if a == b:
            assert torch.equal(packed_S[n], S0[n])
            continue
        o, S = naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                   initial_state=S0[n : n + 1], output_final_state=True)
        assert (packed[:, sl] - o).abs().max() <= 1e-10
        assert (packed_S[n] - S[0]).abs().max() <= 1e-10


def test_causality_bitwise():
    q, k, v, g, beta, _ = make_inputs(1, 50, 2, 8, 8, dtype=torch.float32, seed=6)
    base, _ = torch_chunk_kda(q, k, v, g, beta)
    v2, g2 = v.clone(), g.clone()
    v2[:, 23:] += 1.0
    g2[:, 23:] = -4.9
    moved, _ = torch_chunk_kda(q, k, v2, g2, beta)
    assert torch.equal(moved[:, :23], base[:, :23])
    assert not torch.equal(moved[:, 23:], base[:, 23:])


def test_refuses_chunks_that_could_overflow():
    q, k, v, g, beta, _ = make_inputs(1, 8, 1, 4, 4)
    with pytest.raises(ValueError, match="chunk_size"):
        torch_chunk_kda(q, k, v, g, beta, chunk_size=32)
    with pytest.raises(ValueError, match="80 nats"):
        torch_chunk_kda(q, k, v, g, beta, chunk_size=16, gate_lower_bound=-10.0)
    # with a tighter bound a 16-token chunk is fine; with a looser one, a smaller chunk is
    z = torch.randn(1, 8, 1, 4, dtype=torch.float64)
    g10 = naive_kda_gate(z, torch.zeros(1, dtype=torch.float64), lower_bound=-10.0)
    torch_chunk_kda(q, k, v, g10, beta, chunk_size=8, gate_lower_bound=-10.0)


@pytest.mark.parametrize("C", [1, 5, 16])
def test_packed_documents_equal_padded_batch_with_gradients(C):
    """`chunk_packed_documents` (documents padded only to a chunk multiple, the fast path) against the padded batch
    `run_padded_documents(chunk_form, …)`: outputs, final states and every gradient, fp64 to 1e-12."""
    from k3.ops.kda.reference import chunk_form, chunk_packed_documents, prepare_kda_inputs, run_padded_documents
    from k3.ops.kda.torch_chunk import _factorised_scores

    lengths = [5, 0, 1, 37, 16, 20]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    q, k, v, g, beta, _ = make_inputs(1, sum(lengths), 2, 8, 4, seed=6)
    S0 = torch.randn(len(lengths), 2, 8, 4, dtype=torch.float64)
    w_o, w_s = torch.randn_like(v), torch.randn_like(S0)
    results = []
    for packed in (True, False):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
        q2, k2, v2, g2, b2, S, bounds = prepare_kda_inputs(*leaves[:5], None, leaves[5], cu)
        if packed:
            o, S = chunk_packed_documents(q2, k2, v2, g2, b2, S, bounds, C, _factorised_scores)
        else:
            o, S = run_padded_documents(chunk_form, q2, k2, v2, g2, b2, S, bounds, C, _factorised_scores)
        grads = torch.autograd.grad((o * w_o).sum() + (S * w_s).sum(), leaves)
        results.append((o, S, *grads))
    for name, a, b in zip("o S q k v g beta S0".split(), *results):
        assert (a - b).abs().max() <= 1e-12, name
