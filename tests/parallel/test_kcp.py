"""KCP (segment transitions + fold) equals one pass of naive_recurrent_kda in float64 (docs/distributed.md)."""

import pytest
import torch
import torch.nn.functional as F

from k3.parallel.kcp import fold_states, kcp_kda, kda_transition, split_fragments
from k3.ops.kda import naive_recurrent_kda

H, K, V = 2, 5, 3
TOL = 1e-10


def inputs(T, B=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = F.normalize(x(B, T, H, K), dim=-1)
    k = F.normalize(x(B, T, H, K), dim=-1)
    v = x(B, T, H, V)
    # Mild decays so states from far back still matter and a wrong fold would show.
    g = -0.3 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


def even_bounds(T, R):
    return [T * i // R for i in range(R + 1)]


def check(q, k, v, g, beta, bounds, S0=None, cu=None):
    ref_o, ref_S = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    o, S = kcp_kda(q, k, v, g, beta, bounds, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == ref_o.shape and S.shape == ref_S.shape
    assert (o - ref_o).abs().max() <= TOL
    assert (S - ref_S).abs().max() <= TOL


def test_transition_is_the_affine_map():
    T = 9
    q, k, v, g, beta = inputs(T, seed=1)
    M, S_tilde = kda_transition(k[0], v[0], g[0], beta[0])
    S_in = torch.randn(1, H, K, V, dtype=torch.float64)
    _, S_out = naive_recurrent_kda(q, k, v, g, beta, initial_state=S_in, output_final_state=True)
    assert (M @ S_in[0] + S_tilde - S_out[0]).abs().max() <= TOL
    # Closed form: M = Π_t (I − β_t k_t k_tᵀ) Diag(α_t), latest on the left.
    eye = torch.eye(K, dtype=torch.float64)
    M_ref = eye.expand(H, K, K)
    for t in range(T):
        kt = k[0, t]  # [H, K]
        Mt = (eye - beta[0, t, :, None, None] * kt[:, :, None] * kt[:, None, :]) * g[0, t, :, None, :].exp()
        M_ref = Mt @ M_ref
    assert (M - M_ref).abs().max() <= TOL


@pytest.mark.parametrize("R", [1, 2, 3, 4])
@pytest.mark.parametrize("with_state", [False, True])
def test_single_document(R, with_state):
    T = 23
    q, k, v, g, beta = inputs(T, seed=R)
    S0 = torch.randn(1, H, K, V, dtype=torch.float64) if with_state else None
    check(q, k, v, g, beta, even_bounds(T, R), S0)


def test_batch_rows_and_uneven_segments():
    T = 17
    q, k, v, g, beta = inputs(T, B=2, seed=5)
    S0 = torch.randn(2, H, K, V, dtype=torch.float64)
    for bounds in ([0, 1, 2, 17], [0, 0, 9, 17], [0, 16, 17, 17]):
        check(q, k, v, g, beta, bounds, S0)


@pytest.mark.parametrize("R", [1, 2, 3, 4])
@pytest.mark.parametrize("with_state", [False, True])
def test_documents(R, with_state):
    T = 40
    bounds = even_bounds(T, R)  # 0 10 20 30 40 at R = 4
    # A document spanning three segments (3…33 at R = 4), one starting exactly at a segment edge (10 at
    # R = 4, 20 at R = 2), several documents in one segment, a 1-token document and one empty document.
    cu = torch.tensor([0, 2, 3, 3, 20, 21, 33, 36, 40])
    N = cu.numel() - 1
    q, k, v, g, beta = inputs(T, seed=10 + R)
    S0 = torch.randn(N, H, K, V, dtype=torch.float64) if with_state else None
    check(q, k, v, g, beta, bounds, S0, cu)
    check(q, k, v, g, beta, bounds, S0, torch.tensor([0, 3, 10, 11, 12, 13, 30, 31, 40]))


def test_random_boundaries():
    gen = torch.Generator().manual_seed(0)
    T = 31
    q, k, v, g, beta = inputs(T, seed=99)
    for trial in range(6):
        R = 2 + trial % 3
        cuts = torch.randint(0, T + 1, (5,), generator=gen).sort().values.tolist()
        cu = torch.tensor([0] + cuts + [T])
        bounds = [0] + torch.randint(0, T + 1, (R - 1,), generator=gen).sort().values.tolist() + [T]
        S0 = torch.randn(cu.numel() - 1, H, K, V, dtype=torch.float64)
        check(q, k, v, g, beta, bounds, S0 if trial % 2 else None, cu)


def test_fold_resets_at_document_start():
    # The segment after a document start must not see anything from before it.
    T = 12
    q, k, v, g, beta = inputs(T, seed=3)
    cu = [0, 5, 12]
    bounds = [0, 4, 8, 12]
    frags = split_fragments(cu, bounds)
    assert [[(f.doc, f.start, f.end, f.continues) for f in s] for s in frags] == [
        [(0, 0, 4, False)],
        [(0, 0, 1, True), (1, 1, 4, False)],
        [(1, 0, 4, True)],
    ]
    check(q, k, v, g, beta, bounds, None, torch.tensor(cu))
    # Changing the first document changes nothing in the second one.
    v2 = v.clone()
    v2[:, :5] += 1.0
    o1, _ = kcp_kda(q, k, v, g, beta, bounds, cu_seqlens=torch.tensor(cu))
    o2, _ = kcp_kda(q, k, v2, g, beta, bounds, cu_seqlens=torch.tensor(cu))
    assert torch.equal(o1[:, 5:], o2[:, 5:])


def test_fold_states_chain():
    M = [torch.eye(2).expand(1, 2, 2) * 2, torch.zeros(1, 2, 2)]
    S = [torch.ones(1, 2, 1), torch.full((1, 2, 1), 3.0)]
    states = fold_states(list(zip(M, S)), torch.ones(1, 2, 1))
    assert [s.flatten().tolist() for s in states] == [[1.0, 1.0], [3.0, 3.0]]


def test_gradients_match():
    T = 14
    q, k, v, g, beta = (x.requires_grad_() for x in inputs(T, seed=4))
    cu = torch.tensor([0, 6, 14])
    S0 = torch.randn(2, H, K, V, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, T, H, V, dtype=torch.float64)
    ws = torch.randn(2, H, K, V, dtype=torch.float64)
    grads = []
    for fn in (naive_recurrent_kda, lambda *a, **kw: kcp_kda(*a[:5], [0, 3, 9, 14], **kw)):
        o, S = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
        grads.append(torch.autograd.grad((o * w).sum() + (S * ws).sum(), (q, k, v, g, beta, S0)))
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= TOL


def test_bad_bounds():
    q, k, v, g, beta = inputs(8)
    with pytest.raises(ValueError):
        kcp_kda(q, k, v, g, beta, [0, 5, 4, 8])
    with pytest.raises(ValueError):
        kcp_kda(q, k, v, g, beta, [0, 7])
