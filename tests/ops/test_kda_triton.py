"""Triton KDA kernels (`chunk_kda`, `fused_recurrent_kda`) against the float64 token recurrence.

On a CUDA machine the tests run on the GPU. On CPU they run through the Triton interpreter, which must be
switched on before Triton is imported; `test_in_triton_interpreter` therefore re-runs this module in a
subprocess with TRITON_INTERPRET=1, and the kernel tests skip in the parent process.

Tolerances (relative RMSE vs the fp64 recurrence on the same inputs) are issue #5's for bf16 inputs:
output and final state 5e-3; dq, dk, dv, dh0, ddt_bias 8e-3; dz, dA_log, dβ 2e-2. fp32 inputs get a
fifth of those in the interpreter (exact fp32), and 1.5× them on a GPU: there fp32 operands are rounded to tf32
(10-bit mantissa) inside every dot, which bf16 inputs never are (their products are exact), and the reference
keeps the full fp32 inputs (H200, runs 9-10: o 1.3e-3, S 1.4e-3, dt_bias 3.7e-3, and A_log 2.1e-2, one
cancelling sum per head, on varlen [1, 0, 17, 70]). Layer-level comparisons with the torch path allow 1e-3 in the
interpreter and 2e-3 on a GPU (tf32 again: 1.07e-3 and 1.14e-3 in run 9).

Legend: B batch, T tokens, H heads, K key dim, V value dim, N sequences.
"""


import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda import naive_kda_gate, naive_recurrent_kda
from tests.interpreter import INTERPRETING, run_module_in_interpreter

ON_GPU = torch.cuda.is_available()
F64 = torch.float64
LAYER_TOL = 2e-3 if ON_GPU else 1e-3  # the KDA layer against its torch path (fp32 activations; tf32 on a GPU)
NAMES = ("q", "k", "v", "z", "b", "A_log", "dt_bias", "h0")
TOL = {"o": 5e-3, "S": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "h0": 8e-3, "dt_bias": 8e-3,
       "z": 2e-2, "A_log": 2e-2, "b": 2e-2}


@pytest.mark.skipif(ON_GPU or INTERPRETING, reason="kernels run directly in this process")
def test_in_triton_interpreter():
    pytest.importorskip("triton")
    run_module_in_interpreter(__file__)


@pytest.fixture
def dev():
    if not (ON_GPU or INTERPRETING):
        pytest.skip("runs in the interpreter subprocess (test_in_triton_interpreter)")
    return "cuda" if ON_GPU else "cpu"


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_raw(B, T, H, K, V, seed=0, N=None, dtype=torch.bfloat16, bias=8.0, z_scale=1.0):
    """Raw layer inputs: q, k as after conv + SiLU, z decay logits, β logits, A_log, dt_bias, initial state."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = F.silu(randn(B, T, H, K)), F.silu(randn(B, T, H, K))
    v, z, b = randn(B, T, H, V), z_scale * randn(B, T, H, K), randn(B, T, H)
    A_log = torch.rand(H, generator=gen)
    dt_bias = bias * randn(H * K)
    h0 = randn(B if N is None else N, H, K, V)
    return [x.to(dtype) for x in (q, k, v, z, b)] + [A_log, dt_bias, h0]


def reference(q, k, v, z, b, A_log, dt_bias, h0, g_min=-5.0, cu_seqlens=None, scale=None):
    """The layer's math (L2 norms, gate, β) in fp64 around `naive_recurrent_kda`."""
    q, k, v, z, b = (x.double() for x in (q, k, v, z, b))
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = naive_kda_gate(z, A_log.double(), dt_bias.double(), g_min)
    return naive_recurrent_kda(qn, kn, v, g, torch.sigmoid(b), scale=scale,
                               initial_state=None if h0 is None else h0.double(), output_final_state=True,
                               cu_seqlens=cu_seqlens)


def run_both(inputs, dev, g_min=-5.0, cu_seqlens=None, seed=1):
    """chunk_kda and the fp64 reference on the same inputs and random cotangents; returns outputs and grads."""
    from k3.ops.kda import chunk_kda

    tri_in = [x.to(dev).requires_grad_() for x in inputs]
    ref_in = [x.detach().double().requires_grad_() for x in inputs]
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    o, S = chunk_kda(*tri_in[:7], gate_lower_bound=g_min, initial_state=tri_in[7], output_final_state=True,
                     cu_seqlens=None if cu is None else cu.to(dev))
    ro, rS = reference(*ref_in, g_min=g_min, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(seed)
    do, dS = torch.randn(ro.shape, generator=gen, dtype=F64), torch.randn(rS.shape, generator=gen, dtype=F64)
    ((o.double() * do.to(dev)).sum() + (S.double() * dS.to(dev)).sum()).backward()
    ((ro * do).sum() + (rS * dS).sum()).backward()
    return (o, S, [x.grad for x in tri_in]), (ro, rS, [x.grad for x in ref_in])


def check(tri, ref, dtype, what=""):
    (o, S, grads), (ro, rS, rgrads) = tri, ref
    shrink = 1.0 if dtype == torch.bfloat16 else (1.5 if ON_GPU else 0.2)
    errs = {"o": rel_err(o.cpu(), ro), "S": rel_err(S.cpu(), rS)}
    errs.update({n: rel_err(g.cpu(), r) for n, g, r in zip(NAMES, grads, rgrads)})
    for name, e in errs.items():
        assert e <= shrink * TOL[name], (what, name, e, errs)
    assert torch.isfinite(o).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("T", [1, 15, 17, 63, 65])
def test_matches_fp64_recurrence(dev, T):
    for dtype in (torch.bfloat16, torch.float32):
        inputs = make_raw(2, T, 2, 32, 32, seed=T, dtype=dtype)
        check(*run_both(inputs, dev), dtype, (T, dtype))


def test_long_sequence(dev):
    inputs = make_raw(1, 1000, 1, 32, 32, seed=3)
    check(*run_both(inputs, dev), torch.bfloat16)


def test_full_head_dim(dev):
    inputs = make_raw(1, 130, 1, 128, 128, seed=4, bias=2.0)
    check(*run_both(inputs, dev), torch.bfloat16)


def test_varlen_tiny_documents(dev):
    lengths = [1, 0, 2, 64, 3, 1, 70, 16]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    inputs = make_raw(1, cu[-1], 2, 16, 32, seed=5, N=len(lengths))
    check(*run_both(inputs, dev, cu_seqlens=cu), torch.bfloat16)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's σ(±1e4)
@pytest.mark.parametrize("g_min", [-5.0, -1.0, -0.1])
def test_gate_lower_bounds_and_extreme_gate_inputs(dev, g_min):
    """Decay logits at ±1e4 saturate the gate to both ends; huge |bias| likewise."""
    inputs = make_raw(1, 90, 2, 32, 32, seed=6, bias=30.0)
    z = inputs[3].float()
    z[:, ::3] = 1e4
    z[:, 1::3] = -1e4
    inputs[3] = z.to(inputs[3].dtype)
    check(*run_both(inputs, dev, g_min=g_min), torch.bfloat16, g_min)


def test_all_decays_at_the_lower_bound(dev):
    """Every g = −5: the factorised in-chunk exponents reach their largest magnitude (e^±75)."""
    inputs = make_raw(1, 128, 1, 32, 32, seed=7)
    inputs[3] = torch.full_like(inputs[3], 1e4)
    tri, ref = run_both(inputs, dev)
    assert rel_err(tri[0].cpu(), ref[0]) <= TOL["o"] and rel_err(tri[1].cpu(), ref[1]) <= TOL["S"]
    assert all(torch.isfinite(g).all() for g in tri[2])


@pytest.mark.parametrize("p", [20, 64, 100])
def test_causality_bitwise(dev, p):
    from k3.ops.kda import chunk_kda

    a = make_raw(1, 150, 2, 32, 32, seed=8)
    b = make_raw(1, 150, 2, 32, 32, seed=9)
    o1 = chunk_kda(*(x.to(dev) for x in a[:7]), initial_state=a[7].to(dev))[0]
    for x, y in zip(a[:5], b[:5]):
        x[:, p:] = y[:, p:]
    o2 = chunk_kda(*(x.to(dev) for x in a[:7]), initial_state=a[7].to(dev))[0]
    assert torch.equal(o1[:, :p], o2[:, :p])
    assert not torch.equal(o1[:, p:], o2[:, p:])


@pytest.mark.parametrize("T1", [1, 64, 77])
def test_split_call_with_carried_state(dev, T1):
    from k3.ops.kda import chunk_kda

    inputs = [x.to(dev) for x in make_raw(2, 150, 2, 32, 32, seed=10, dtype=torch.float32)]
    full, full_S = chunk_kda(*inputs[:7], initial_state=inputs[7], output_final_state=True)
    first = [x[:, :T1] for x in inputs[:5]]
    rest = [x[:, T1:] for x in inputs[:5]]
    o1, S1 = chunk_kda(*first, *inputs[5:7], initial_state=inputs[7], output_final_state=True)
    o2, S2 = chunk_kda(*rest, *inputs[5:7], initial_state=S1, output_final_state=True)
    # fp32 inputs; on a GPU both runs multiply in tf32 (~5e-4 each)
    assert rel_err(torch.cat((o1, o2), 1), full) <= 2e-3 and rel_err(S2, full_S) <= 2e-3


def test_nan_initial_state_stays_in_its_sequence(dev):
    from k3.ops.kda import chunk_kda

    lengths = [40, 70, 0, 30]
    cu = torch.tensor([0, 40, 110, 110, 140], device=dev)
    inputs = [x.to(dev) for x in make_raw(1, 140, 2, 32, 32, seed=11, N=4)]
    clean, clean_S = chunk_kda(*inputs[:7], initial_state=inputs[7], output_final_state=True, cu_seqlens=cu)
    h0 = inputs[7].clone()
    h0[1] = float("nan")
    o, S = chunk_kda(*inputs[:7], initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o[:, 40:110].isnan().all() and S[1].isnan().all()
    keep = torch.ones(140, dtype=torch.bool, device=dev)
    keep[40:110] = False
    assert torch.equal(o[:, keep], clean[:, keep])
    for n in (0, 2, 3):
        assert torch.equal(S[n], clean_S[n])
    assert torch.equal(S[2], h0[2]) and len(lengths) == S.shape[0]
    # a dense batch as well: row 1's NaN stays in row 1
    dense = [x.to(dev) for x in make_raw(3, 80, 2, 32, 32, seed=12)]
    base = chunk_kda(*dense[:7], initial_state=dense[7])[0]
    h0 = dense[7].clone()
    h0[1, 0, 3, 5] = float("nan")
    o = chunk_kda(*dense[:7], initial_state=h0)[0]
    assert o[1].isnan().any() and torch.equal(o[0], base[0]) and torch.equal(o[2], base[2])


def _fwd_bwd(inputs, dev, seed=21, **kw):
    """chunk_kda forward + backward (with dht) on fresh leaves; returns outputs and gradients."""
    from k3.ops.kda import chunk_kda

    leaves = [x.to(dev).requires_grad_() for x in inputs]
    o, S, *hs = chunk_kda(*leaves[:7], initial_state=leaves[7], output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    do, dS = torch.randn(o.shape, generator=gen).to(o), torch.randn(S.shape, generator=gen).to(S)
    torch.autograd.backward((o, S), (do, dS))
    return [o.detach(), S.detach(), *hs] + [x.grad for x in leaves]


@pytest.mark.parametrize("case", ["bf16", "fp32", "varlen_all_bf16_state_bf16"])
def test_saved_intermediates_match_recompute_bitwise(dev, monkeypatch, case):
    """The backward with the forward's kept operands and states gives bit-identical gradients to the one
    that recomputes them, and really skips the recompute: one `_prepare` and one `_state` launch per call."""
    from k3.ops.kda import triton_chunk as tc

    calls = []
    prepare, state = tc._fwd_prepare, tc._fwd_state
    monkeypatch.setattr(tc, "_fwd_prepare", lambda *a, **k: calls.append(("prepare", k)) or prepare(*a, **k))
    monkeypatch.setattr(tc, "_fwd_state", lambda *a, **k: calls.append(("state", k)) or state(*a, **k))
    kw = {}
    if case == "varlen_all_bf16_state_bf16":
        cu = [0, 5, 70, 70, 150]
        inputs = make_raw(1, cu[-1], 2, 32, 32, seed=22, N=len(cu) - 1)
        kw = dict(cu_seqlens=torch.tensor(cu, device=dev), return_chunk_states=True, all_bf16=True,
                  state_bf16=True)
    else:
        inputs = make_raw(2, 70, 2, 32, 32, seed=23, dtype=torch.bfloat16 if case == "bf16" else torch.float32)
    runs = {}
    for save in (False, True):
        calls.clear()
        runs[save] = _fwd_bwd(inputs, dev, save_intermediates=save, **kw)
        prepares = [k for name, k in calls if name == "prepare"]
        states = [k for name, k in calls if name == "state"]
        assert len(prepares) == len(states) == (1 if save else 2), (save, calls)
        assert prepares[0].get("store_t", False) == save
        assert states[0].get("want_hs", False) == (save or kw.get("return_chunk_states", False))
    assert len(runs[True]) == len(runs[False])
    for a, b in zip(runs[True], runs[False]):
        assert a is not None and torch.equal(a, b)
    # the default (None) saves when a backward follows
    calls.clear()
    _fwd_bwd(inputs, dev, **kw)
    assert sum(name == "prepare" for name, _ in calls) == 1


def test_saved_intermediates_only_when_a_backward_follows(dev, monkeypatch):
    """No grad mode or no input that requires grad: nothing extra is computed or kept."""
    from k3.ops.kda import chunk_kda
    from k3.ops.kda import triton_chunk as tc

    calls = []
    prepare, state = tc._fwd_prepare, tc._fwd_state
    monkeypatch.setattr(tc, "_fwd_prepare", lambda *a, **k: calls.append(k) or prepare(*a, **k))
    monkeypatch.setattr(tc, "_fwd_state", lambda *a, **k: calls.append(k) or state(*a, **k))
    inputs = [x.to(dev) for x in make_raw(1, 70, 2, 32, 32, seed=24)]
    with torch.no_grad():
        o, _ = chunk_kda(*(x.clone().requires_grad_() for x in inputs[:7]), save_intermediates=True)
    o2, _ = chunk_kda(*inputs[:7], save_intermediates=True)
    assert o.grad_fn is None and o2.grad_fn is None and torch.equal(o, o2)
    assert len(calls) == 4 and not any(k.get("store_t") or k.get("want_hs") for k in calls), calls
    # switched off, a training forward keeps nothing and the backward recomputes
    calls.clear()
    leaves = [x.clone().requires_grad_() for x in inputs[:7]]
    chunk_kda(*leaves, save_intermediates=False)[0].sum().backward()
    assert len(calls) == 4 and not calls[0].get("store_t")


def test_saved_intermediates_survive_retain_graph(dev):
    """A second backward over a retained graph reuses the kept tensors and gives the same gradients."""
    from k3.ops.kda import chunk_kda

    leaves = [x.to(dev).requires_grad_() for x in make_raw(1, 70, 2, 32, 32, seed=25)]
    o, _ = chunk_kda(*leaves[:7], initial_state=leaves[7], save_intermediates=True)
    loss = (o.float() * torch.linspace(-1, 1, o.shape[-1], device=dev)).sum()
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_saved_intermediates_under_activation_checkpointing(dev):
    """Non-reentrant checkpointing (the model's) drops the kept tensors and recomputes them with the layer."""
    from torch.utils.checkpoint import checkpoint

    from k3.ops.kda import chunk_kda

    inputs = make_raw(1, 70, 2, 32, 32, seed=26)
    grads = []
    for ckpt in (False, True):
        leaves = [x.to(dev).requires_grad_() for x in inputs]

        def f(*xs):
            return chunk_kda(*xs[:7], initial_state=xs[7], save_intermediates=True)[0]

        o = checkpoint(f, *leaves, use_reentrant=False) if ckpt else f(*leaves)
        (o.float() * torch.linspace(-1, 1, o.shape[-1], device=dev)).sum().backward()
        grads.append([x.grad for x in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_chunk_states_for_prefix_caching(dev):
    from k3.ops.kda import chunk_kda

    cu = [0, 150, 170]
    inputs = make_raw(1, 170, 2, 32, 32, seed=13, N=2, dtype=torch.float32)
    o, ht, hs = chunk_kda(*(x.to(dev) for x in inputs[:7]), initial_state=inputs[7].to(dev),
                          output_final_state=True, cu_seqlens=torch.tensor(cu, device=dev), return_chunk_states=True)
    assert hs.shape == (3 + 1, 2, 32, 32)
    starts = [(0, 0), (0, 64), (0, 128), (1, 150)]
    for c, (n, t) in enumerate(starts):
        doc = slice(cu[n], t)
        if t == cu[n]:
            want = inputs[7][n]
        else:
            want = reference(*(x[:, doc] for x in inputs[:5]), *inputs[5:7], inputs[7][n : n + 1])[1][0]
        assert rel_err(hs[c].cpu(), want) <= 2e-3, c


def test_decode_slots_in_place_and_all_states(dev):
    from k3.ops.kda import fused_recurrent_kda

    N, T, H, K, V = 3, 3, 2, 32, 64
    q, k, v, z, b, A_log, dt_bias, _ = make_raw(N, T, H, K, V, seed=14, bias=4.0)
    pool = torch.randn(5, H, K, V, generator=torch.Generator().manual_seed(15))
    idx = torch.tensor([4, -1, 1])
    before = pool.clone()
    pool_d = pool.to(dev)
    o, all_states = fused_recurrent_kda(*(x.to(dev) for x in (q, k, v, z, b, A_log, dt_bias)), pool_d,
                                        idx.to(dev), return_all_states=True)
    assert (o[1] == 0).all()
    for n, slot in ((0, 4), (2, 1)):
        ro, rS = reference(*(x[n : n + 1] for x in (q, k, v, z, b)), A_log, dt_bias, before[slot : slot + 1])
        assert rel_err(o[n].cpu(), ro[0]) <= TOL["o"]
        assert rel_err(pool_d[slot].cpu(), rS[0]) <= 1e-4
        for t in range(T):
            rS_t = reference(*(x[n : n + 1, : t + 1] for x in (q, k, v, z, b)), A_log, dt_bias,
                             before[slot : slot + 1])[1]
            assert rel_err(all_states[n, t].cpu(), rS_t[0]) <= 1e-4
    for slot in (0, 2, 3):
        assert torch.equal(pool_d[slot].cpu(), before[slot])


def test_decode_after_prefill_equals_longer_prefill(dev):
    from k3.ops.kda import chunk_kda, fused_recurrent_kda

    inputs = [x.to(dev) for x in make_raw(2, 70, 2, 32, 32, seed=16, dtype=torch.float32)]
    full, full_S = chunk_kda(*inputs[:7], initial_state=inputs[7], output_final_state=True)
    _, S = chunk_kda(*(x[:, :67] for x in inputs[:5]), *inputs[5:7], initial_state=inputs[7], output_final_state=True)
    outs = []
    for t in range(67, 70):
        o, _ = fused_recurrent_kda(*(x[:, t : t + 1] for x in inputs[:5]), *inputs[5:7], S)
        outs.append(o)
    assert rel_err(torch.cat(outs, 1), full[:, 67:]) <= 2e-3 and rel_err(S, full_S) <= 2e-3


def _layer_pair(dev):
    from k3.config import get_preset
    from k3.model.kda import KimiDeltaAttention

    cfg = get_preset("debug")  # H = 2, K = V = 64
    torch.manual_seed(0)
    ref_layer = KimiDeltaAttention(cfg.replace(kda_impl="torch"), 0).to(dev)
    tri_layer = KimiDeltaAttention(cfg.replace(kda_impl="triton"), 0).to(dev)
    with torch.no_grad():
        ref_layer.dt_bias.normal_(0, 2)
        ref_layer.A_log.uniform_(0, 1)
    tri_layer.load_state_dict(ref_layer.state_dict())
    return cfg, ref_layer, tri_layer


def test_layer_triton_matches_torch(dev):
    """The KDA layer with kda_impl="triton" against "torch": prefill with cache, decode, packed, gradients."""
    from k3.model.sequence import SequenceLayout

    cfg, ref_layer, tri_layer = _layer_pair(dev)
    x = torch.randn(2, 70, cfg.hidden_size, device=dev)
    layout = SequenceLayout.build(2, 70, None, dev)
    y_ref, st_ref = ref_layer(x, layout, use_cache=True)
    y_tri, st_tri = tri_layer(x, layout, use_cache=True)
    assert rel_err(y_tri, y_ref) <= LAYER_TOL and rel_err(st_tri.recurrent, st_ref.recurrent) <= LAYER_TOL
    (y_ref * y_ref).sum().backward()
    (y_tri * y_tri).sum().backward()
    for (name, p), p2 in zip(ref_layer.named_parameters(), tri_layer.parameters()):
        assert rel_err(p2.grad, p.grad) <= 5e-3, name
    with torch.no_grad():
        x1 = torch.randn(2, 1, cfg.hidden_size, device=dev)
        one = SequenceLayout.build(2, 1, None, dev)
        d_ref, s_ref = ref_layer(x1, one, st_ref, use_cache=True)
        d_tri, s_tri = tri_layer(x1, one, st_tri, use_cache=True)
        assert rel_err(d_tri, d_ref) <= LAYER_TOL and rel_err(s_tri.recurrent, s_ref.recurrent) <= LAYER_TOL
        packed = SequenceLayout.build(1, 70, torch.tensor([0, 5, 6, 70]), dev)
        p_ref, _ = ref_layer(x[:1], packed)
        p_tri, _ = tri_layer(x[:1], packed)
        assert rel_err(p_tri, p_ref) <= LAYER_TOL


def test_layer_training_path_fuses_short_conv(dev, monkeypatch):
    """Training (no cache): q/k/v conv + SiLU run as the fused kernel; outputs and all gradients match."""
    import k3.model.kda as kda_module
    from k3.model.sequence import SequenceLayout

    calls = []
    fused = kda_module.short_conv_silu
    monkeypatch.setattr(kda_module, "short_conv_silu", lambda *a, **k: calls.append(1) or fused(*a, **k))
    cfg, ref_layer, tri_layer = _layer_pair(dev)
    for rows, cu in ((1, torch.tensor([0, 5, 6, 70], device=dev)), (2, None)):
        x = torch.randn(rows, 70 if cu is not None else 35, cfg.hidden_size, device=dev)
        layout = SequenceLayout.build(rows, x.shape[1], cu, dev)
        xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, _ = ref_layer(xr, layout)
        y_tri, _ = tri_layer(xt, layout)
        assert rel_err(y_tri, y_ref) <= LAYER_TOL
        (y_ref * y_ref).sum().backward()
        (y_tri * y_tri).sum().backward()
        assert rel_err(xt.grad, xr.grad) <= 5e-3
        for (name, p), p2 in zip(ref_layer.named_parameters(), tri_layer.parameters()):
            assert rel_err(p2.grad, p.grad) <= 5e-3, name
            p.grad = p2.grad = None
    assert len(calls) == 6  # q, k, v in both layouts


@pytest.mark.skipif(INTERPRETING, reason="checks the path taken without the interpreter")
def test_layer_triton_on_cpu_falls_back_to_torch():
    from k3.model.sequence import SequenceLayout

    cfg, ref_layer, tri_layer = _layer_pair("cpu")
    x = torch.randn(2, 40, cfg.hidden_size)
    layout = SequenceLayout.build(2, 40, None, "cpu")
    y_ref, st_ref = ref_layer(x, layout, use_cache=True)
    y_tri, st_tri = tri_layer(x, layout, use_cache=True)
    assert torch.equal(y_tri, y_ref) and torch.equal(st_tri.recurrent, st_ref.recurrent)


def test_errors(dev):
    from k3.ops.kda import chunk_kda

    q, k, v, z, b, A_log, dt_bias, h0 = (x.to(dev) for x in make_raw(1, 20, 2, 32, 32))
    with pytest.raises(ValueError, match="gate_lower_bound"):
        chunk_kda(q, k, v, z, b, A_log, dt_bias, gate_lower_bound=-6.0)
    with pytest.raises(ValueError, match="power of two"):
        chunk_kda(q[..., :24], k[..., :24], v, z[..., :24], b, A_log, dt_bias[: 2 * 24])
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(q, k, v, z, b, A_log, dt_bias, initial_state=h0[:, :1])
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda(q, k, v, z, b, A_log, dt_bias, cu_seqlens=torch.tensor([0, 5, 19], device=dev))


def test_launch_options_follow_tuning(monkeypatch):
    """TUNING's optional per-kernel num_stages / maxnreg reach the launch only when set (benchmarks/kda.py
    --tuning sweeps them); warps always do."""
    pytest.importorskip("triton")
    from k3.ops.kda import triton_chunk as tc

    monkeypatch.setitem(tc.TUNING, "prepare_maxnreg", 128)
    assert tc._launch_options("prepare") == {"num_warps": tc.TUNING["prepare_warps"], "maxnreg": 128}
    assert tc._launch_options("state") == {"num_warps": tc.TUNING["state_warps"],
                                           "num_stages": tc.TUNING["state_stages"]}
    monkeypatch.setitem(tc.TUNING, "bwd_k_stages", 3)
    monkeypatch.setitem(tc.TUNING, "bwd_k_maxnreg", None)
    assert tc._launch_options("bwd_k")["num_stages"] == 3 and "maxnreg" not in tc._launch_options("bwd_k")


# the split `_prepare` (TUNING["prepare_split"]: `_prep_intra`, `_prep_solve`, `_prep_wu`; docs/kda-kernels.md §7)

SPLIT_CASES = {
    # name: (document lengths, H, K, V, input dtype, all_bf16, g_min); V = 128 gives `_prep_wu` two U slices
    "dense_bf16": ([65, 65], 1, 32, 32, torch.bfloat16, False, -5.0),
    "varlen_bf16": ([1, 17, 0, 65, 130], 1, 16, 128, torch.bfloat16, False, -5.0),
    "varlen_all_bf16": ([130, 1, 17], 2, 32, 32, torch.bfloat16, True, -0.1),
    "dense_fp32": ([70], 2, 32, 32, torch.float32, False, -1.0),
}


PREPARED = ("W", "U", "Qg", "Kd", "Aqk", "gc", "T")  # `_fwd_prepare`'s outputs, in order


def _prepare_both_ways(spec, dev, monkeypatch, seed, switch, **tuning):
    """`_fwd_prepare` (store_t) on the inputs of a SPLIT_CASES-style spec with TUNING[switch] off and on (after
    the `tuning` entries): ({False: outputs, True: outputs}, document offsets, H, a call without store_t)."""
    from k3.ops.kda import triton_chunk as tc

    lengths, H, K, V, dtype, all_bf16, g_min = spec
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    q, k, v, z, b, A_log, dt_bias, _ = (x.to(dev) for x in make_raw(1, offsets[-1], H, K, V, seed=seed, N=1,
                                                                    dtype=dtype, bias=2.0))
    q, k, v, z, b = (x[0] for x in (q, k, v, z, b))
    plan = tc._Plan(tuple(offsets), torch.device(dev))
    dtypes = tc.inter_dtypes(dtype, all_bf16)

    def prepare(**kw):
        return tc._fwd_prepare(q, k, v, z, b, A_log, dt_bias, g_min, K ** -0.5, plan, dtypes, **kw)

    for key, value in tuning.items():
        monkeypatch.setitem(tc.TUNING, key, value)
    runs = {}
    for on in (False, True):
        monkeypatch.setitem(tc.TUNING, switch, on)
        runs[on] = prepare(store_t=True)
    return runs, offsets, H, prepare


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_prepare_split_matches_fused(dev, monkeypatch, case):
    """The three split kernels write what `_prepare` writes (W, U, Q⊙Γ, K⊙exp(G_C − G), Aqk, G_C, T), same
    shapes, dtypes and layouts. The score blocks use the same factorisation and helpers, so the only
    differences are summation orders: the W and U products over column slices instead of whole 64-row tiles
    (and, on a GPU, different dot tilings and cumsum orders). Tolerances, relative RMSE: for fp32-stored outputs
    1e-5 in the interpreter (it gives 0 for all but W and U, ≤ 3e-8 there) and 1e-4 on a GPU, where the gate's
    cumsum runs in another order per 16-row block: G reaches −320 in a chunk, so its fp32 rounding moves
    exp(±G) by ~320·6e-8 ≈ 2e-5 (H200, run 6: Aqk 1.3e-5); 3e-4 for bf16-stored ones, where an fp32
    difference of ~1e-7 flips the rounding of a small fraction of the elements by one bf16 ulp (3.9e-3)."""
    runs, offsets, H, prepare = _prepare_both_ways(SPLIT_CASES[case], dev, monkeypatch, 31, "prepare_split")
    for name, a, r in zip(PREPARED, runs[True], runs[False]):
        assert a.shape == r.shape and a.dtype == r.dtype and a.stride() == r.stride(), name
        assert torch.isfinite(a).all(), name
        tol = (1e-4 if ON_GPU else 1e-5) if a.dtype == torch.float32 else 3e-4
        assert rel_err(a.cpu(), r.cpu()) <= tol, (case, name, rel_err(a.cpu(), r.cpu()))
    # T's upper blocks and Aqk's are zeros in both (read back as 64×64 tiles)
    T = runs[True][6].cpu()
    for s, e in zip(offsets[:-1], offsets[1:]):
        for c0 in range(s, e, 64):
            rows = torch.arange(min(64, e - c0))
            upper = rows[:, None] < torch.arange(64)[None, :]
            assert (T[c0: c0 + len(rows)][upper[:, None, :].expand(-1, H, -1)] == 0).all()
    # without store_t the split path returns None for T, like the fused one
    assert prepare()[6] is None


@pytest.mark.parametrize("case", ["T65_bf16", "T17_fp32", "varlen"])
def test_prepare_split_matches_fp64_recurrence(dev, monkeypatch, case):
    """`chunk_kda` forward and backward with the split `_prepare` (the fused kernel is made unusable) against the
    fp64 recurrence, at the file's tolerances."""
    from k3.ops.kda import triton_chunk as tc

    monkeypatch.setitem(tc.TUNING, "prepare_split", True)
    monkeypatch.setattr(tc, "_prepare", None)  # any launch of the fused kernel would fail
    if case == "varlen":
        lengths = [1, 0, 2, 64, 3, 70, 16]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        inputs = make_raw(1, cu[-1], 2, 16, 32, seed=5, N=len(lengths))
        check(*run_both(inputs, dev, cu_seqlens=cu), torch.bfloat16, case)
        return
    T, dtype = (65, torch.bfloat16) if case == "T65_bf16" else (17, torch.float32)
    inputs = make_raw(2, T, 2, 32, 32, seed=T, dtype=dtype)
    check(*run_both(inputs, dev), dtype, case)


# the split `_bwd_k` (TUNING["bwd_k_split"]: key slices of `bwd_ks_cols` columns, then `_bwd_norms`)

BWD_SPLIT_CASES = {
    # name: (document lengths, H, K, V, input dtype, slice width): K / width slices
    "dense_bf16_2slices": ([65, 65], 2, 32, 32, torch.bfloat16, 16),
    "varlen_fp32_2slices": ([1, 0, 17, 70], 1, 32, 32, torch.float32, 16),
    "K64_bf16_2slices": ([130], 1, 64, 32, torch.bfloat16, 32),
    "one_slice": ([40], 1, 32, 32, torch.bfloat16, 32),
}


@pytest.mark.parametrize("case", list(BWD_SPLIT_CASES))
def test_bwd_k_split_matches_fused(dev, monkeypatch, case):
    """Every gradient of `chunk_kda` with the key-sliced `_bwd_k` + `_bwd_norms` against the fused `_bwd_k`, and
    both against the fp64 recurrence. The slices do the same per-column arithmetic; only the norm backward's and
    dβ's sums over K run in another order (and, on a GPU, the dots tile differently). Tolerance, relative RMSE:
    1e-5 in the interpreter (measured ≤ 1.2e-7, dz 8e-7 where bf16 roundings flip); 1e-3 on a GPU, where those
    flips move the bf16 dz by 2.1e-4 and dt_bias (its sum) by 1.1e-4 (H200, run 9)."""
    from k3.ops.kda import triton_chunk as tc

    lengths, H, K, V, dtype, cols = BWD_SPLIT_CASES[case]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    inputs = make_raw(1, cu[-1], H, K, V, seed=5, N=len(lengths), dtype=dtype)
    monkeypatch.setitem(tc.TUNING, "bwd_ks_cols", cols)
    runs = {}
    for split in (False, True):
        monkeypatch.setitem(tc.TUNING, "bwd_k_split", split)
        runs[split] = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)
    tol = 1e-3 if ON_GPU else 1e-5
    (o, S, grads), _ = runs[True]
    (ro, rS, rgrads), _ = runs[False]
    assert torch.equal(o, ro) and torch.equal(S, rS)
    for name, a, r in zip(NAMES, grads, rgrads):
        assert torch.isfinite(a).all(), name
        assert rel_err(a.cpu(), r.cpu()) <= tol, (case, name, rel_err(a.cpu(), r.cpu()))
    check(*runs[True], dtype, case)


def test_both_splits_against_fp64_recurrence(dev, monkeypatch):
    """The split `_prepare` and the split `_bwd_k` together, every gradient against the fp64 recurrence."""
    from k3.ops.kda import triton_chunk as tc

    monkeypatch.setitem(tc.TUNING, "prepare_split", True)
    monkeypatch.setitem(tc.TUNING, "bwd_k_split", True)
    monkeypatch.setitem(tc.TUNING, "bwd_ks_cols", 16)
    inputs = make_raw(2, 70, 2, 32, 32, seed=9)
    check(*run_both(inputs, dev), torch.bfloat16, "both splits")


# the gate pre-pass (TUNING["prepare_gate_pass"] with prepare_split: `_prep_gate`, then `_prep_intra_g`, `_prep_solve`,
# `_prep_wu_g`; docs/kda-kernels.md §7 item 12)

# 40: a partial 16-row block whose anchor G is below −88 (exp(−G) overflows fp32; padded rows must not use it)
GATE_PASS_CASES = {**SPLIT_CASES, "varlen_fp32": ([0, 1, 17, 40, 65, 130], 2, 32, 32, torch.float32, False, -5.0)}


@pytest.mark.parametrize("case", list(GATE_PASS_CASES))
def test_prepare_gate_pass_matches_split(dev, monkeypatch, case):
    """With the gate pre-pass the split `_prepare` writes the same seven outputs (same shapes, dtypes, layouts).
    `_prep_gate` sums G as `_prep_intra` does (per 16-row block, continuing from the previous block's last row),
    so Q⊙Γ, Aqk and T are bit-identical in the interpreter. W, K⊙exp(G_C − G) and G_C used a 64-row cumsum in
    `_prep_wu`; the association differs, which moves G by a few ulps (|G| ≤ 320). Tolerances, relative RMSE: 1e-5
    for fp32-stored outputs in the interpreter (measured: G_C 1.4e-7, W 4e-8, K⊙exp(G_C − G) 1.7e-6, where
    G_C − G is small against G's ulp), 1e-4 on a GPU (as `test_prepare_split_matches_fused`: other cumsum orders
    move exp(±G) by ~2e-5); 3e-4 for bf16-stored ones, where such differences flip a few roundings by one bf16
    ulp (measured 2.5e-5)."""
    runs, _, _, prepare = _prepare_both_ways(GATE_PASS_CASES[case], dev, monkeypatch, 37, "prepare_gate_pass",
                                             prepare_split=True)
    for name, a, r in zip(PREPARED, runs[True], runs[False]):
        assert a.shape == r.shape and a.dtype == r.dtype and a.stride() == r.stride(), name
        assert torch.isfinite(a).all(), name
        if name in ("U", "Qg", "Aqk", "T") and not ON_GPU:
            assert torch.equal(a, r), (case, name, rel_err(a.cpu(), r.cpu()))
        tol = (1e-4 if ON_GPU else 1e-5) if a.dtype == torch.float32 else 3e-4
        assert rel_err(a.cpu(), r.cpu()) <= tol, (case, name, rel_err(a.cpu(), r.cpu()))
    assert prepare()[6] is None


@pytest.mark.parametrize("case", ["T65_bf16", "T17_fp32", "varlen"])
def test_prepare_gate_pass_matches_fp64_recurrence(dev, monkeypatch, case):
    """`chunk_kda` forward and backward with the gate pre-pass (`_prep_intra`, `_prep_wu` and the fused `_prepare`
    made unusable) against the fp64 recurrence at the file's tolerances, and against the split path without the
    pre-pass: the backward is the same, so only the forward's W, K⊙exp(G_C − G) and G_C differ (see
    `test_prepare_gate_pass_matches_split`); 1e-5 relative in the interpreter, 1e-3 on a GPU (as
    `test_bwd_k_split_matches_fused`: single bf16 roundings flip)."""
    from k3.ops.kda import triton_chunk as tc

    if case == "varlen":
        lengths = [1, 0, 2, 64, 3, 70, 16]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        inputs, dtype = make_raw(1, cu[-1], 2, 16, 32, seed=5, N=len(lengths)), torch.bfloat16
    else:
        T, dtype = (65, torch.bfloat16) if case == "T65_bf16" else (17, torch.float32)
        inputs, cu = make_raw(2, T, 2, 32, 32, seed=T, dtype=dtype), None
    monkeypatch.setitem(tc.TUNING, "prepare_split", True)
    runs = {}
    for gate_pass in (False, True):
        monkeypatch.setitem(tc.TUNING, "prepare_gate_pass", gate_pass)
        if gate_pass:
            for name in ("_prepare", "_prep_intra", "_prep_wu"):
                monkeypatch.setattr(tc, name, None)  # any launch of these would fail
        runs[gate_pass] = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)
    check(*runs[True], dtype, case)
    (o, S, grads), _ = runs[True]
    (ro, rS, rgrads), _ = runs[False]
    tol = 1e-3 if ON_GPU else 1e-5
    for name, a, r in zip(("o", "S") + NAMES, [o, S, *grads], [ro, rS, *rgrads]):
        assert rel_err(a.cpu(), r.cpu()) <= tol, (case, name, rel_err(a.cpu(), r.cpu()))


# the value-side backward over key slices (TUNING["bwd_v_split"]: `_bwd_vk`, `_bwd_vv` from the forward's Ũ;
# docs/kda-kernels.md §7 item 13)

BWD_V_SPLIT_CASES = {
    # name: (document lengths or None for a dense [2, 70] batch, H, K, V, input dtype, slice width, extra chunk_kda
    # arguments, TUNING overrides)
    "dense_fp32_2slices": (None, 2, 32, 32, torch.float32, 16, {}, {}),
    "dense_bf16_2slices": (None, 2, 32, 32, torch.bfloat16, 16, {}, {}),
    "varlen_fp32": ([0, 1, 17, 65, 130], 1, 32, 64, torch.float32, 16, {}, {}),
    "varlen_bf16_K16_V128": ([1, 17, 0, 65, 130], 1, 16, 128, torch.bfloat16, 32, {}, {}),
    "varlen_all_bf16_1slice": ([130, 1, 17, 0, 65], 2, 32, 32, torch.bfloat16, 32, {"all_bf16": True}, {}),
    "recompute_fp32": (None, 2, 32, 32, torch.float32, 16, {"save_intermediates": False}, {}),
    "recompute_varlen_bf16_fused_bwd_k": ([0, 1, 17, 65, 130], 1, 32, 32, torch.bfloat16, 16,
                                          {"save_intermediates": False}, {"bwd_k_split": False}),
}


@pytest.mark.parametrize("case", list(BWD_V_SPLIT_CASES))
def test_bwd_v_split_matches_default(dev, monkeypatch, case):
    """Every gradient of `chunk_kda` with the split value side (`_bwd_vu` and `_bwd_vw` made unusable) against the
    default path, and against the fp64 recurrence at the file's tolerances (initial state and dht included).

    Outputs are bit-identical (the forward only stores Ũ besides). The slices do the per-column arithmetic of
    `_bwd_vu` / `_bwd_vw`; the sums over K (dT, dβ) are taken per slice and added in `_bwd_vv`. The one real
    difference is Ũ: the default recomputes it in `_bwd_vu` from an fp32 W = T·diag(β)(K⊙Γ), the split path
    reads the forward's Ũ = U − W·S, made with the stored W (bf16 for bf16 inputs), the Ũ the output was
    computed from. Tolerance, relative RMSE: fp32 inputs 1e-5 in the interpreter (measured ≤ 1.1e-6, dA_log, one
    cancelling sum per head; the rest ≤ 4.2e-7) and 1e-3 on a GPU (as the file's other split tests: other dot
    tilings, tf32); bf16 inputs 5e-3, where dAqk and dKd move with W's bf16 rounding (measured ≤ 1.5e-3, dq and dk;
    dv, dβ and dh0 do not depend on Ũ and match), 1e-2 with all_bf16, where Ũ is stored in bf16 as U is (measured
    dk 3.7e-3; against fp64 dk 3.8e-3 instead of 2.2e-3, within the 8e-3 of `check`)."""
    import functools

    import k3.ops.kda
    from k3.ops.kda import triton_chunk as tc

    lengths, H, K, V, dtype, cols, kw, tuning = BWD_V_SPLIT_CASES[case]
    if lengths is None:
        inputs, cu = make_raw(2, 70, H, K, V, seed=41, dtype=dtype), None
    else:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        inputs = make_raw(1, cu[-1], H, K, V, seed=41, N=len(lengths), dtype=dtype)
    monkeypatch.setattr(k3.ops.kda, "chunk_kda", functools.partial(tc.chunk_kda, **kw))
    monkeypatch.setitem(tc.TUNING, "bwd_vk_cols", cols)
    for key, value in tuning.items():
        monkeypatch.setitem(tc.TUNING, key, value)
    runs = {}
    for split in (False, True):
        monkeypatch.setitem(tc.TUNING, "bwd_v_split", split)
        if split:
            for name in ("_bwd_vu", "_bwd_vw"):
                monkeypatch.setattr(tc, name, None)  # any launch of these would fail
        runs[split] = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)
    (o, S, grads), _ = runs[True]
    (ro, rS, rgrads), _ = runs[False]
    assert torch.equal(o, ro) and torch.equal(S, rS)
    tol = (1e-3 if ON_GPU else 1e-5) if dtype == torch.float32 else (1e-2 if kw.get("all_bf16") else 5e-3)
    for name, a, r in zip(NAMES, grads, rgrads):
        assert torch.isfinite(a).all(), name
        assert rel_err(a.cpu(), r.cpu()) <= tol, (case, name, rel_err(a.cpu(), r.cpu()))
    check(*runs[True], dtype, case)


@pytest.mark.parametrize("case", ["fp32", "varlen_bf16"])
def test_bwd_v_split_kept_matches_recompute_bitwise(dev, monkeypatch, case):
    """With the split value side the forward keeps Ũ (an eighth kept tensor, from the `_state` launch that writes
    o) and the recompute path makes it in the backward's `_state`: same kernels on the same inputs, so the
    gradients are bit-identical either way. The default path neither stores nor keeps it."""
    from k3.ops.kda import triton_chunk as tc

    calls = []
    state = tc._fwd_state
    monkeypatch.setattr(tc, "_fwd_state", lambda *a, **k: calls.append(k) or state(*a, **k))
    monkeypatch.setitem(tc.TUNING, "bwd_vk_cols", 16)
    kw = {}
    if case == "varlen_bf16":
        cu = [0, 5, 70, 70, 150]
        inputs = make_raw(1, cu[-1], 2, 32, 32, seed=42, N=len(cu) - 1)
        kw = dict(cu_seqlens=torch.tensor(cu, device=dev))
    else:
        inputs = make_raw(2, 70, 2, 32, 32, seed=43, dtype=torch.float32)
    monkeypatch.setitem(tc.TUNING, "bwd_v_split", True)
    runs = {}
    for save in (False, True):
        calls.clear()
        runs[save] = _fwd_bwd(inputs, dev, save_intermediates=save, **kw)
        # kept: the forward's `_state` stores Ũ; recomputed: the backward's does
        assert [k.get("want_ut", False) for k in calls] == ([True] if save else [False, True]), (save, calls)
    for a, b in zip(runs[True], runs[False]):
        assert a is not None and torch.equal(a, b)
    monkeypatch.setitem(tc.TUNING, "bwd_v_split", False)
    calls.clear()
    _fwd_bwd(inputs, dev, **kw)
    assert len(calls) == 1 and not calls[0]["want_ut"]
