"""Triton KDA kernels (`chunk_kda`, `fused_recurrent_kda`) against the float64 token recurrence.

On a CUDA machine the tests run on the GPU. On CPU they run through the Triton interpreter, which must be
switched on before Triton is imported; `test_in_triton_interpreter` therefore re-runs this module in a
subprocess with TRITON_INTERPRET=1 (tests/interpreter.py), and the kernel tests skip in the parent process.

Tolerances (relative RMSE vs the fp64 recurrence on the same inputs), for bf16 inputs:
output and final state 5e-3; dq, dk, dv, dh0, ddt_bias 8e-3; dz, dA_log, dβ 2e-2. fp32 inputs get a
fifth of those in the interpreter (exact fp32), and 1.5× them on a GPU: there fp32 operands are rounded to tf32
(10-bit mantissa) inside every dot, which bf16 inputs never are (their products are exact), and the reference
keeps the full fp32 inputs (measured on an H200: o 1.3e-3, S 1.4e-3, dt_bias 3.7e-3, and A_log 2.1e-2, one
cancelling sum per head, on varlen [1, 0, 17, 70]). Layer-level comparisons with the torch path allow 1e-3 in the
interpreter and 2e-3 on a GPU (tf32 again: up to 1.14e-3 measured).

Legend: B batch, T tokens, H heads, K key dim, V value dim, N sequences.
"""


import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda import naive_kda_gate, naive_recurrent_kda
from tests.interpreter import INTERPRETING, ON_GPU, cases, kernel_device, repeats, rerun_in_interpreter

F64 = torch.float64
LAYER_TOL = 2e-3 if ON_GPU else 1e-3  # the KDA layer against its torch path (fp32 activations; tf32 on a GPU)
NAMES = ("q", "k", "v", "z", "b", "A_log", "dt_bias", "h0")
TOL = {"o": 5e-3, "S": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "h0": 8e-3, "dt_bias": 8e-3,
       "z": 2e-2, "A_log": 2e-2, "b": 2e-2}


test_in_triton_interpreter = rerun_in_interpreter(__file__)


@pytest.fixture(autouse=True)
def _prefill_at_every_size(monkeypatch):
    """Forwards no backward follows take the inference kernels (`chunk_prefill`) at these tests' small shapes too:
    chunk_kda picks them only with enough programs to fill a GPU (`prefill_applies`, tested on its own)."""
    if ON_GPU or INTERPRETING:
        from k3.ops.kda import chunk as tc

        monkeypatch.setitem(tc.TUNING, "prefill_min_programs", 0)


@pytest.fixture
def dev():
    return kernel_device()


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


def run_both(inputs, dev, g_min=-5.0, cu_seqlens=None, seed=1, **kw):
    """chunk_kda (with kw) and the fp64 reference on the same inputs and random cotangents; returns outputs and
    grads."""
    from k3.ops.kda import chunk_kda

    tri_in = [x.to(dev).requires_grad_() for x in inputs]
    ref_in = [x.detach().double().requires_grad_() for x in inputs]
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    o, S = chunk_kda(*tri_in[:7], gate_lower_bound=g_min, initial_state=tri_in[7], output_final_state=True,
                     cu_seqlens=None if cu is None else cu.to(dev), **kw)
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


@pytest.mark.parametrize("T", cases(1, 15, 17, 63, 65, gpu_only=(15, 63)))
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


def test_score_backward_on_32_row_blocks(dev, monkeypatch):
    """TUNING["bwd_k_rows"] = 32: `_bwd_k_block` on two 32-row blocks per chunk, anchored at their middle rows, passes
    the fp64 tolerances on packed documents and matches the 16-row kernel's gradients to 1e-4 (measured in the
    interpreter ≤ 1.4e-5; the rest of the backward is the same), also with every decay at the lower bound, where
    the diagonal factors reach e^±80 and the blocks' products underflow; the forward is untouched. Other values
    are refused."""
    from k3.ops.kda import chunk as tc

    cu = [0, 70, 71, 71, 150]
    packed = make_raw(1, cu[-1], 2, 32, 32, seed=67, N=len(cu) - 1)
    floor = make_raw(1, 128, 1, 32, 32, seed=7)
    floor[3] = torch.full_like(floor[3], 1e4)  # every g = −5
    for inputs, kw in ((packed, dict(cu_seqlens=cu)), (floor, {})):
        runs = {}
        for rows in (16, 32):
            monkeypatch.setitem(tc.TUNING, "bwd_k_rows", rows)
            runs[rows], ref = run_both([x.clone() for x in inputs], dev, **kw)
        if kw:
            check(runs[32], ref, torch.bfloat16, "bwd_k_rows 32")
        assert torch.equal(runs[32][0], runs[16][0]) and torch.equal(runs[32][1], runs[16][1])
        assert all(torch.isfinite(g).all() for g in runs[32][2])
        diffs = {n: rel_err(a, b) for n, a, b in zip(NAMES, runs[32][2], runs[16][2])}
        # (at the floor every G is a multiple of −5 and the two anchorings round alike: there the gradients agree
        # bit for bit in the interpreter)
        assert max(diffs.values()) <= 1e-4 and (diffs["z"] > 0 or not kw), diffs
    monkeypatch.setitem(tc.TUNING, "bwd_k_rows", 64)
    with pytest.raises(ValueError, match="bwd_k_rows"):
        run_both(make_raw(1, 17, 1, 16, 16, seed=44), dev)


@pytest.mark.parametrize("p", cases(20, 64, 100, gpu_only=(100,)))
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


@pytest.mark.parametrize("T1", cases(1, 64, 77, gpu_only=(77,)))
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
    """chunk_kda forward + backward (with dht) on fresh leaves (copies: on CPU `.to(dev)` would return the inputs
    themselves, and two calls would accumulate into the same .grad tensors); returns outputs and gradients."""
    from k3.ops.kda import chunk_kda

    leaves = [x.detach().to(dev, copy=True).requires_grad_() for x in inputs]
    o, S, *hs = chunk_kda(*leaves[:7], initial_state=leaves[7], output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    do, dS = torch.randn(o.shape, generator=gen).to(o), torch.randn(S.shape, generator=gen).to(S)
    torch.autograd.backward((o, S), (do, dS))
    return [o.detach(), S.detach(), *hs] + [x.grad for x in leaves]


@pytest.mark.parametrize("case", cases("bf16", "fp32", "varlen_all_bf16_state_bf16",
                                       "varlen_bf16_2slices_bf16_storage",
                                       gpu_only=("bf16", "varlen_all_bf16_state_bf16")))
def test_saved_intermediates_match_recompute_bitwise(dev, monkeypatch, case):
    """The backward with the forward's kept operands, states and Ũ gives bit-identical gradients to the one
    that recomputes them, and really skips the recompute: one prepare and one `_state` launch per call. Ũ comes
    from the forward's `_state` when kept, else from the backward's. o is bit-identical too, except where a kept
    forward computes it from the stored bf16 states and Ũ (`state_o_apart`; then within o's fp64 tolerance of the
    other)."""
    from k3.ops.kda import chunk as tc

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
    elif case == "varlen_bf16_2slices_bf16_storage":
        # every backward intermediate in bf16, the returned chunk-start states fp32 (the backward rounds the kept
        # ones as the recompute stores them)
        cu = [0, 5, 70, 70, 150]
        inputs = make_raw(1, cu[-1], 2, 32, 32, seed=42, N=len(cu) - 1)
        kw = dict(cu_seqlens=torch.tensor(cu, device=dev), return_chunk_states=True)
        monkeypatch.setitem(tc.TUNING, "bwd_vk_cols", 16)
        monkeypatch.setitem(tc.TUNING, "bwd_k_cols", 16)
        monkeypatch.setitem(tc.TUNING, "bwd_storage_bf16", ["hs", "ut", "dse", "du"])
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
        assert [k.get("want_ut", False) for k in states] == ([True] if save else [False, True]), (save, calls)
    assert len(runs[True]) == len(runs[False])
    # a kept forward's o comes from the stored bf16 states and Ũ (`state_o_apart`), a recomputing one's from `_state`
    u_dtype = tc.inter_dtypes(inputs[0].dtype, kw.get("all_bf16", False))[1]
    apart = tc.output_apart(inputs[0].dtype, u_dtype, True, kw.get("return_chunk_states", False))
    for i, (a, b) in enumerate(zip(runs[True], runs[False])):
        if i == 0 and apart:
            assert rel_err(a.cpu(), b.double().cpu()) < TOL["o"] and not torch.equal(a, b)
        else:
            assert a is not None and torch.equal(a, b), i
    if case == "bf16":  # the default (None) saves when a backward follows: a policy, checked once
        calls.clear()
        _fwd_bwd(inputs, dev, **kw)
        assert sum(name == "prepare" for name, _ in calls) == 1


def test_training_output_apart_from_the_state_pass(dev, monkeypatch):
    """TUNING["state_o_apart"]: the training forward's o from the stored bf16 chunk-start states and Ũ (`_fwd_o`, on
    two value blocks here) instead of inside `_state` passes the fp64 tolerances on packed documents (a one-token and
    an empty one among them), leaves the final state and every gradient bit-identical (the backward reads the same
    stored tensors), also without an initial state, and does nothing for fp32 inputs (their states are stored in
    fp32). `fwd_o_loop` (one program walking both value blocks) gives the same o bit for bit."""
    from k3.ops.kda import chunk as tc
    from k3.ops.kda import chunk_kda

    cu = [0, 70, 71, 71, 150]
    inputs = make_raw(1, cu[-1], 2, 32, 64, seed=7, N=len(cu) - 1)
    monkeypatch.setitem(tc.TUNING, "fwd_o_bv", 32)
    runs = {}
    for apart in (False, True):
        monkeypatch.setitem(tc.TUNING, "state_o_apart", apart)
        runs[apart], ref = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)
    check(runs[True], ref, torch.bfloat16, "state_o_apart")
    assert not torch.equal(runs[True][0], runs[False][0])  # the path ran
    assert torch.equal(runs[True][1], runs[False][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[True][2], runs[False][2]))
    # one program per (chunk, head) over both value blocks (`fwd_o_loop`): the same products, the same o
    monkeypatch.setitem(tc.TUNING, "fwd_o_loop", True)
    looped = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)[0]
    monkeypatch.setitem(tc.TUNING, "fwd_o_loop", False)
    assert torch.equal(looped[0], runs[True][0]) and all(torch.equal(a, b) for a, b in zip(looped[2], runs[True][2]))
    no_h0 = {}
    for apart in (False, True):
        monkeypatch.setitem(tc.TUNING, "state_o_apart", apart)
        leaves = [x.to(dev).requires_grad_() for x in inputs[:7]]
        o = chunk_kda(*leaves, cu_seqlens=torch.tensor(cu, device=dev))[0]
        o.float().square().sum().backward()
        no_h0[apart] = [o.detach()] + [x.grad for x in leaves]
    assert rel_err(no_h0[True][0].cpu(), no_h0[False][0].double().cpu()) < TOL["o"]
    assert not torch.equal(no_h0[True][0], no_h0[False][0])
    assert all(torch.equal(a, b) for a, b in zip(no_h0[True][1:], no_h0[False][1:]))
    fp32 = [x.float() if i < 5 else x for i, x in enumerate(make_raw(1, 70, 2, 32, 16, seed=3))]
    outs = {}
    for apart in (False, True):
        monkeypatch.setitem(tc.TUNING, "state_o_apart", apart)
        outs[apart] = run_both([x.clone() for x in fp32], dev)[0]
    assert torch.equal(outs[True][0], outs[False][0])


def _backward_switch_checks(monkeypatch, key, inputs, dev, new, base, ref, cu, all_bf16):
    """What every backward switch read at the forward owes, with TUNING[key] on (`new`) against off (`base`), both
    `run_both` results with the fp64 `ref`: each gradient within 1.3× the default path's error from fp64 (on a GPU a
    tenth of the tolerance more: its tf32 dots, exact in the interpreter, move the small sums, dA_log's two entries
    most, 1.7-2.0× when imitated in the interpreter); kept and recomputing backwards bit-identical; and the switch
    read once, at the forward: flipped off before the backward, the gradients are the kept ones."""
    from k3.ops.kda import chunk as tc
    from k3.ops.kda import chunk_kda

    for name, a, b, r in zip(NAMES, new[2], base[2], ref[2]):
        slack = 0.1 * TOL[name] if ON_GPU else 0.0
        assert rel_err(a.cpu(), r) <= 1.3 * rel_err(b.cpu(), r) + slack, name
    kw = dict(cu_seqlens=torch.tensor(cu, device=dev), all_bf16=all_bf16)
    kept = _fwd_bwd(inputs, dev, save_intermediates=True, **kw)
    again = _fwd_bwd(inputs, dev, save_intermediates=False, **kw)
    assert all(torch.equal(a, b) for a, b in zip(kept[2:], again[2:]))
    leaves = [x.detach().to(dev, copy=True).requires_grad_() for x in inputs]
    o, S = chunk_kda(*leaves[:7], initial_state=leaves[7], output_final_state=True, **kw)
    monkeypatch.setitem(tc.TUNING, key, False)
    gen = torch.Generator().manual_seed(21)
    do, dS = torch.randn(o.shape, generator=gen).to(o), torch.randn(S.shape, generator=gen).to(S)
    torch.autograd.backward((o, S), (do, dS))
    assert all(torch.equal(x.grad, g) for x, g in zip(leaves, kept[2:]))


# fp32 inputs and all_bf16 only change what the kernels load and store; Q′ with all_bf16 also runs in
# test_norm_sums_from_scores
@pytest.mark.parametrize("dtype,all_bf16", cases((torch.bfloat16, False), (torch.float32, False),
                                                 (torch.bfloat16, True),
                                                 gpu_only=((torch.float32, False), (torch.bfloat16, True))))
def test_state_bwd_on_qprime(dev, monkeypatch, dtype, all_bf16):
    """TUNING["state_bwd_qprime"]: `_state_bwd` on Q′ = Q⊙Γ − Aqk·W, with dŨ's Aqkᵀ·dO taken in `_bwd_vk` and
    `_bwd_vv`, passes the fp64 tolerances on packed documents (a one-token and an empty one among them), leaves o
    and the final state bit-identical (the forward still computes o from Q⊙Γ) and dq too (it never reads dŨ), moves
    every other gradient (the path ran) and keeps each within 1.3× the default path's error from fp64 (measured in
    the interpreter: at most 1.14×, dA_log in bf16; dv, dt_bias and most fp32 ones closer; a tenth of the tolerance
    more on a GPU, whose tf32 dots move the small sums), and keeps the kept
    and recomputing backwards bit-identical (`_prep_wu` writes Q′ beside Q⊙Γ in one, over it in the other). With
    all_bf16 (Aqk stored in bf16) the same, but the fp64 tolerances, which that variant is not held to. The switch
    is read at the forward: flipping it before the backward changes nothing."""
    from k3.ops.kda import chunk as tc

    cu = [0, 70, 71, 71, 150]
    inputs = make_raw(1, cu[-1], 2, 32, 64, seed=65, N=len(cu) - 1, dtype=dtype)
    base, ref = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu, all_bf16=all_bf16)
    monkeypatch.setitem(tc.TUNING, "state_bwd_qprime", True)
    qp, ref = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu, all_bf16=all_bf16)
    if not all_bf16:  # (U and Aqk in bf16 too: a measured variant, outside the kernels' stated tolerances)
        check(qp, ref, dtype, "state_bwd_qprime")
    assert torch.equal(qp[0], base[0]) and torch.equal(qp[1], base[1]) and torch.equal(qp[2][0], base[2][0])
    assert all(not torch.equal(a, b) for a, b in zip(qp[2][1:], base[2][1:]))
    _backward_switch_checks(monkeypatch, "state_bwd_qprime", inputs, dev, qp, base, ref, cu, all_bf16)


# fp32 inputs only change what the kernels load and store: the bf16 cases take the same branches
@pytest.mark.parametrize("dtype,all_bf16,others", cases(
    (torch.bfloat16, False, {"bwd_vk_cols": 16, "bwd_k_cols": 16}),
    (torch.float32, False, {}),
    (torch.bfloat16, True, {"state_bwd_qprime": True, "bwd_k_rows": 32}),
    gpu_only=((torch.float32, False, {}),)))
def test_norm_sums_from_scores(dev, monkeypatch, dtype, all_bf16, others):
    """TUNING["norms_from_scores"]: the norm backward's and dβ's sums over K taken from the scores (Euler's identity,
    in `_bwd_vv`, on the Ã the prepare keeps), `_bwd_k_block` finishing dq and dk and no `_bwd_norms`, passes the
    fp64 tolerances on packed documents (a one-token and an empty one among them), leaves o, the final state and
    every gradient but dq, dk and dβ's bit-identical, moves those three (the path ran) and keeps each within 1.3× the
    default path's error from fp64 (a tenth of the tolerance more on a GPU, whose tf32 dots move the small sums), and
    keeps the kept and recomputing backwards bit-identical. With all_bf16 (Aqk stored in bf16 too), Q′
    (`state_bwd_qprime`, which loads Aqk in `_bwd_vv` as well) and 32-row score blocks (`bwd_k_rows`) on both sides the
    same, but the fp64 tolerances, which all_bf16 is not held to; the bf16 case runs two key slices in `_bwd_vk` and
    `_bwd_k_block` (the sums over their partials). Measured in the interpreter: dq, dk and dβ 0.93-1.0× the default
    path's error (one rounding of dq̂, dk̂ fewer, against the sums taken on the stored scores, whose bf16 operands
    differ from the backward's fp32 ones). The switch is read at the forward: flipping it before the backward
    changes nothing."""
    from k3.ops.kda import chunk as tc

    cu = [0, 70, 71, 71, 150]
    inputs = make_raw(1, cu[-1], 2, 32, 64, seed=66, N=len(cu) - 1, dtype=dtype)
    for key, value in {**others, "norms_from_scores": False}.items():
        monkeypatch.setitem(tc.TUNING, key, value)
    base, ref = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu, all_bf16=all_bf16)
    monkeypatch.setitem(tc.TUNING, "norms_from_scores", True)
    new, ref = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu, all_bf16=all_bf16)
    if not all_bf16:
        check(new, ref, dtype, "norms_from_scores")
    assert torch.equal(new[0], base[0]) and torch.equal(new[1], base[1])
    assert [torch.equal(a, b) for a, b in zip(new[2], base[2])] == [False, False, True, True, False, True, True, True]
    _backward_switch_checks(monkeypatch, "norms_from_scores", inputs, dev, new, base, ref, cu, all_bf16)


def _nan_filled_allocations(monkeypatch):
    """From here on torch.empty and torch.empty_like return NaN-filled tensors (integers: −7), so that a read of
    memory nothing has written yet, or not yet visibly, shows in the results (the split-K tests below: a program
    that read its siblings' partials before their stores landed would read NaN, not a previous run's values)."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(x):
        return x.fill_(float("nan")) if x.is_floating_point() else x.fill_(-7)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(empty_like(*a, **k)))


@pytest.mark.parametrize("others", [{}, {"bwd_k_rows": 32, "norms_from_scores": True, "bwd_k_cols": 16,
                                     "bwd_gate_cols": 16}])
def test_gate_chain_in_score_backward(dev, monkeypatch, others):
    """TUNING["bwd_gate_fused"]: the last of a chunk's row blocks to finish on a key slice runs `_bwd_gate`'s
    reverse cumsum and gate chain (`_gate_chain`, the same code on the same dG, read from L2), so every output and
    gradient is bit-identical to the separate launch's, whichever block finishes last: on packed documents whose
    last chunks hold one to four 16-row blocks (and a one-token and an empty document), with 16- and 32-row blocks,
    one and two key slices (the fused chain runs on the score backward's slices whatever `bwd_gate_cols` says; the
    separate launch here on the same ones, so that dA_log's partials sum in the same order), with and without the
    sums from the scores. Kept and recomputing backwards' gradients agree bit for bit. The fused runs allocate
    NaN-filled memory (`_nan_filled_allocations`); on a GPU, where the chain's code could in principle compile
    differently in its host kernel, the results may differ by 1e-6 (a stale dG would differ by its whole size)."""
    from k3.ops.kda import chunk as tc

    cu = [0, 70, 71, 71, 100, 148, 211]
    inputs = make_raw(1, cu[-1], 2, 32, 32, seed=67, N=len(cu) - 1)
    for key, value in others.items():
        monkeypatch.setitem(tc.TUNING, key, value)
    kw = dict(cu_seqlens=torch.tensor(cu, device=dev))
    base = _fwd_bwd(inputs, dev, **kw)
    monkeypatch.setitem(tc.TUNING, "bwd_gate_fused", True)
    _nan_filled_allocations(monkeypatch)
    fused = _fwd_bwd(inputs, dev, **kw)
    for a, b in zip(fused, base):
        assert torch.equal(a, b) if not ON_GPU else rel_err(a.cpu(), b.cpu()) <= 1e-6
    # (o too, but a forward that keeps nothing computes it inside `_state`: `state_o_apart`)
    again = _fwd_bwd(inputs, dev, save_intermediates=False, **kw)
    assert all(torch.equal(a, b) for a, b in zip(again[2:], fused[2:]))


@pytest.mark.parametrize("others", [{"bwd_vk_cols": 16}, {"norms_from_scores": True, "state_bwd_qprime": True,
                                                         "bwd_vk_cols": 16, "bwd_gate_fused": True}])
def test_value_chain_in_key_slices(dev, monkeypatch, others):
    """TUNING["bwd_vv_fused"]: the last of a chunk's `_bwd_vk` slice programs to finish runs `_bwd_vv`'s work
    (`_vv_chain`, the same code on the other slices' partials read from L2), so every output and gradient equals the
    separate launch's: bit for bit in the interpreter, within 1e-5 on a GPU (where the chain runs at `_bwd_vk`'s launch
    settings; the fused runs allocate NaN-filled memory, `_nan_filled_allocations`, so a partial read before its
    store landed would show). On packed documents with a one-token and an empty one, on two key slices (one would
    count to one), plain and with Q′, the sums from the scores (whose row dots are partials too) and the fused gate
    chain. Kept and recomputing backwards' gradients agree bit for bit."""
    from k3.ops.kda import chunk as tc

    cu = [0, 70, 71, 71, 100, 148]
    inputs = make_raw(1, cu[-1], 2, 32, 64, seed=68, N=len(cu) - 1)
    for key, value in others.items():
        monkeypatch.setitem(tc.TUNING, key, value)
    kw = dict(cu_seqlens=torch.tensor(cu, device=dev))
    base = _fwd_bwd(inputs, dev, **kw)
    monkeypatch.setitem(tc.TUNING, "bwd_vv_fused", True)
    _nan_filled_allocations(monkeypatch)
    fused = _fwd_bwd(inputs, dev, **kw)
    for a, b in zip(fused, base):
        assert torch.equal(a, b) if not ON_GPU else rel_err(a.cpu(), b.cpu()) <= 1e-5
    again = _fwd_bwd(inputs, dev, save_intermediates=False, **kw)
    assert all(torch.equal(a, b) for a, b in zip(again[2:], fused[2:]))


def test_backward_bf16_storage(dev, monkeypatch):
    """TUNING["bwd_storage_bf16"]: the chunk-start states, Ũ, dS_end and dŨ stored in bf16 for bf16 inputs (the
    value side multiplies them as stored) pass the fp64 tolerances, leave the forward bit-identical and change the
    gradients (the path ran); with `bwd_scratch_bf16` as well, only dq and dk change again; `bwd_da_bf16` (dAqk,
    dAkk in bf16) moves the score side's gradients and neither dv nor dh0, and does nothing for fp32 inputs. The
    tensors saved for the backward are bf16 where named, fp32 for fp32 inputs. Names outside the four are
    refused."""
    from k3.ops.kda import chunk as tc

    cu = [0, 40, 41, 100]
    inputs = make_raw(1, cu[-1], 2, 32, 64, seed=43, N=len(cu) - 1)
    monkeypatch.setitem(tc.TUNING, "bwd_storage_bf16", [])
    monkeypatch.setitem(tc.TUNING, "bwd_scratch_bf16", False)
    # o inside `_state` whatever the storage (`state_o_apart` computes it from bf16 stored states: its own test)
    monkeypatch.setitem(tc.TUNING, "state_o_apart", False)
    base, ref = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)
    monkeypatch.setitem(tc.TUNING, "bwd_storage_bf16", ["hs", "ut", "dse", "du"])
    stored, ref = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)
    check(stored, ref, torch.bfloat16, "bf16 storage")
    assert torch.equal(stored[0], base[0]) and torch.equal(stored[1], base[1])
    assert all(not torch.equal(a, b) for a, b in zip(stored[2][:7], base[2][:7]))
    # the scratch dq̂, dk̂ in bf16 too (`bwd_scratch_bf16`): only dq and dk move
    monkeypatch.setitem(tc.TUNING, "bwd_scratch_bf16", True)
    scratch, ref = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)
    check(scratch, ref, torch.bfloat16, "bf16 scratch")
    assert [torch.equal(a, b) for a, b in zip(scratch[2], stored[2])] == [False, False] + [True] * 6
    monkeypatch.setitem(tc.TUNING, "bwd_scratch_bf16", False)
    # dAqk, dAkk the other way round (`bwd_da_bf16`): everything the score side reaches moves, dv and dh0 do not
    da_bf16 = tc.TUNING["bwd_da_bf16"]
    monkeypatch.setitem(tc.TUNING, "bwd_da_bf16", not da_bf16)
    flipped, ref = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)
    check(flipped, ref, torch.bfloat16, "bwd_da_bf16 flipped")
    assert [torch.equal(a, b) for a, b in zip(flipped[2], stored[2])] == [False, False, True] + [False] * 4 + [True]
    fp32 = [x.float() if i < 5 else x for i, x in enumerate(make_raw(1, 70, 2, 32, 16, seed=3))]
    grads = {}
    for flag in (True, False):
        monkeypatch.setitem(tc.TUNING, "bwd_da_bf16", flag)
        grads[flag] = run_both([x.clone() for x in fp32], dev)[0][2]
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    monkeypatch.setitem(tc.TUNING, "bwd_da_bf16", da_bf16)

    def saved_dtypes(dtype, names):
        """dtypes of the saved chunk-start states [NT, H, K, V] and Ũ ([TT, H, V], not v itself); V = 16 is no
        other saved tensor's last dim."""
        monkeypatch.setitem(tc.TUNING, "bwd_storage_bf16", names)
        leaves = [x.to(dev, dtype if i < 5 else x.dtype).requires_grad_()
                  for i, x in enumerate(make_raw(1, 70, 2, 32, 16, seed=3)[:7])]
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            tc.chunk_kda(*leaves)
        states = [t.dtype for t in seen if t.dim() == 4 and t.shape[2:] == (32, 16)]
        ut = [t.dtype for t in seen if t.dim() == 3 and t.shape[-1] == 16 and t.data_ptr() != leaves[2].data_ptr()]
        return states, ut

    assert saved_dtypes(torch.bfloat16, ["hs", "ut"]) == ([torch.bfloat16], [torch.bfloat16])
    assert saved_dtypes(torch.bfloat16, ["dse", "du"]) == ([torch.float32], [torch.float32])
    assert saved_dtypes(torch.float32, ["hs", "ut", "dse", "du"]) == ([torch.float32], [torch.float32])
    monkeypatch.setitem(tc.TUNING, "bwd_storage_bf16", ["h"])
    with pytest.raises(ValueError, match="bwd_storage_bf16"):
        run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)


@pytest.mark.parametrize("key", ["state_bv", "state_ut_bv", "state_bwd_bv"])
def test_state_value_blocks_do_not_change_results(dev, monkeypatch, key):
    """The state passes' value block (a launch setting, swept by benchmarks) splits independent value columns:
    64 against the default 32 gives the same results up to the matmul's summation order (BLAS blocking in the
    interpreter, tile shapes on a GPU). state_bv is the 64-token inference forward's launch, state_ut_bv the training
    forward's (it also stores Ũ), state_bwd_bv the backward state pass."""
    from k3.ops.kda import chunk as tc
    from k3.ops.kda import chunk_kda, chunk_state

    inputs = make_raw(1, 80, 2, 32, 64, seed=31, dtype=torch.float32)
    monkeypatch.setitem(tc.TUNING, "prefill", False)  # the inference forward in 64-token chunks

    def run():
        if key == "state_bv":
            with torch.no_grad():
                x = [t.to(dev) for t in inputs]
                return list(chunk_kda(*x[:7], initial_state=x[7], output_final_state=True)[:2])
        return _fwd_bwd(inputs, dev)

    base = run()
    monkeypatch.setitem(tc.TUNING, key, 64)
    launched = []
    state = chunk_state._state
    monkeypatch.setattr(chunk_state, "_state", type("Spy", (), {"__getitem__": lambda self, grid: launched.append(grid)
                                                                or state[grid]})())
    wide = run()
    if key != "state_bwd_bv":
        assert launched and launched[0][0] == 1, launched  # the first `_state` launch took V // 64 value blocks
    # the state passes' split-bf16 products carry ~16 mantissa bits: another summation order can flip one hi/lo
    # rounding (measured: one element in 4096, abs 5.5e-6, rel 1.9e-5)
    for a, b in zip(base, wide):
        torch.testing.assert_close(a, b, rtol=5e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", cases(torch.bfloat16, torch.float32, gpu_only=(torch.bfloat16,)))
def test_state_split_products(dev, monkeypatch, dtype):
    """`_state` with split-bf16 products (`state_split`, the default: each fp32 operand as bf16
    hi + lo, about 16 mantissa bits) pass the fp64 tolerances, and in the interpreter (where tf32 dots are exact
    fp32) stay within 5e-5 of the tf32 path on fp32 inputs, yet differ from it: the split path ran
    (bf16 results: 5e-4, the odd one-ulp flip of a bf16 rounding, 3.9e-3 each)."""
    from k3.ops.kda import chunk as tc

    inputs = make_raw(1, 150, 2, 32, 64, seed=41, N=3, dtype=dtype)
    cu = [0, 40, 41, 150]
    monkeypatch.setitem(tc.TUNING, "state_split", False)
    base, ref = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)  # fresh leaves per run (CPU .to)
    monkeypatch.setitem(tc.TUNING, "state_split", True)
    split, ref = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)
    check(split, ref, dtype, "split")
    pairs = [(split[0], base[0]), (split[1], base[1])] + list(zip(split[2], base[2]))
    if not ON_GPU:
        diffs = [rel_err(a, b) for a, b in pairs]
        assert max(diffs) <= (5e-5 if dtype == torch.float32 else 5e-4), diffs
        if dtype == torch.float32:
            assert any(not torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("products,dtype", cases(("tf32", torch.bfloat16), ("tf32", torch.float32),
                                                ("bf16", torch.bfloat16), gpu_only=(("tf32", torch.bfloat16),)))
def test_state_bwd_products(dev, monkeypatch, products, dtype):
    """`_state_bwd` with tf32 or bf16 products (`state_bwd_products`; split bf16 by default) passes the fp64
    tolerances and leaves the forward bit-identical. In the interpreter (tf32 dots exact in fp32 there) the
    default split path stays within 5e-5 of the tf32 path's gradients on fp32 inputs (5e-4 in bf16), yet differs
    from it: each path ran."""
    from k3.ops.kda import chunk as tc

    inputs = make_raw(1, 100, 2, 32, 64, seed=43, N=3, dtype=dtype)
    cu = [0, 40, 41, 100]
    base, ref = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)
    monkeypatch.setitem(tc.TUNING, "state_bwd_products", products)
    other, ref = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)
    check(other, ref, dtype, products)
    assert torch.equal(other[0], base[0]) and torch.equal(other[1], base[1])
    diffs = [rel_err(a, b) for a, b in zip(other[2], base[2])]
    assert any(d > 0 for d in diffs)
    if not ON_GPU and products == "tf32":
        assert max(diffs) <= (5e-5 if dtype == torch.float32 else 5e-4), diffs


@pytest.mark.parametrize("products,key,value,match", [
    ("fp16", None, None, "state_bwd_products"),
    ("split", "state_bwd_warps", 8, "at 4 warps and 2-3 stages only"),  # outside the H200's measured builds
    ("bf16", "state_bwd_stages", 1, "at 4 warps and 2-3 stages only"),
    ("split", "state_bwd_stages", 4, "at 4 warps and 2-3 stages only")])
def test_state_bwd_products_refused(dev, monkeypatch, products, key, value, match):
    """An unknown product mode, and split or bf16 products at launch settings the H200 built wrong or that were
    never measured there, are refused."""
    from k3.ops.kda import chunk as tc

    monkeypatch.setitem(tc.TUNING, "state_bwd_products", products)
    if key is not None:
        monkeypatch.setitem(tc.TUNING, key, value)
    with pytest.raises(ValueError, match=match):
        run_both(make_raw(1, 17, 1, 16, 16, seed=44), dev)


def test_inference_forward_state_products(dev, monkeypatch):
    """The 64-token inference forward (no backward can follow; `prefill` off) multiplies in split bf16 like the
    training forward (`state_split_inference`, the default), so on these fp32 inputs their outputs
    are bit-identical, whether or not the training forward keeps its operands (for bf16 inputs a training forward
    that keeps them computes o from the stored bf16 states, `state_o_apart`); with it off the inference forward is
    tf32: both within fp64 tolerance, within 5e-5 of each other in the interpreter."""
    from k3.ops.kda import chunk as tc
    from k3.ops.kda import chunk_kda

    inputs = [x.to(dev) for x in make_raw(1, 150, 2, 32, 64, seed=43, dtype=torch.float32)]
    ref, _ = reference(*[x.double() for x in inputs])
    monkeypatch.setitem(tc.TUNING, "prefill", False)  # the inference forward in 64-token chunks

    def forwards():
        with torch.no_grad():
            infer, _ = chunk_kda(*inputs[:7], initial_state=inputs[7])
        train, _ = chunk_kda(*(x.clone().requires_grad_() for x in inputs[:7]), initial_state=inputs[7])
        unkept, _ = chunk_kda(*(x.clone().requires_grad_() for x in inputs[:7]), initial_state=inputs[7],
                              save_intermediates=False)
        assert torch.equal(train, unkept)
        return infer.detach(), train.detach()

    infer, train = forwards()
    assert torch.equal(infer, train)
    monkeypatch.setitem(tc.TUNING, "state_split_inference", False)
    infer, train = forwards()
    for o in (infer, train):
        assert rel_err(o, ref) <= (1.5 if ON_GPU else 0.2) * TOL["o"]
    if not ON_GPU:
        assert rel_err(infer, train) <= 5e-5 and not torch.equal(infer, train)


def _infer(inputs, dev, **kw):
    """chunk_kda under no_grad (the inference forward) with the initial state and the final state returned."""
    from k3.ops.kda import chunk_kda

    x = [t.to(dev) for t in inputs]
    with torch.no_grad():
        return chunk_kda(*x[:7], initial_state=x[7], output_final_state=True, **kw)


def _check_forward(out, ref, dtype, what=""):
    shrink = 1.0 if dtype == torch.bfloat16 else (1.5 if ON_GPU else 0.2)
    errs = {"o": rel_err(out[0].cpu(), ref[0]), "S": rel_err(out[1].cpu(), ref[1])}
    assert all(e <= shrink * TOL[n] for n, e in errs.items()), (what, errs)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all(), what


@pytest.mark.parametrize("T", cases(1, 15, 16, 17, 63, 65, 150, gpu_only=(16, 63, 150)))
def test_prefill_forward_matches_fp64_recurrence(dev, monkeypatch, T):
    """The inference forward at its default chunk (`chunk_prefill`, what chunk_kda runs when no backward can follow)
    against the fp64 recurrence, bf16 and fp32, at lengths around the 16-, 32- and 64-token chunk edges; and beside
    the 64-token inference forward (`prefill` off): fp32 inputs agree to 2e-5 in the interpreter (split-bf16
    products in both)."""
    from k3.ops.kda import chunk as tc

    for dtype in (torch.bfloat16, torch.float32):
        inputs = make_raw(2, T, 2, 32, 32, seed=50 + T, dtype=dtype)
        out = _infer(inputs, dev)
        _check_forward(out, reference(*inputs), dtype, (T, dtype))
    monkeypatch.setitem(tc.TUNING, "prefill", False)
    old = _infer(inputs, dev)
    if not ON_GPU:
        assert rel_err(out[0], old[0]) <= 2e-5 and rel_err(out[1], old[1]) <= 2e-5


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's σ(±1e4)
@pytest.mark.parametrize("g_min,chunk", cases((-5.0, 16), (-1.0, 16), (-0.1, 16), (-5.0, 32), (-1.0, 32), (-0.1, 32),
                                               gpu_only=((-5.0, 16), (-1.0, 16), (-1.0, 32), (-0.1, 32))))
def test_prefill_forward_varlen_and_extreme_gates(dev, monkeypatch, g_min, chunk):
    """Packed documents of 0-70 tokens (chunks never cross one), and gate inputs at ±1e4 with large biases: at
    g_min = −5 whole chunks decay at the bound, where exp(−G) reaches e^80 in the score operands; 16- and 32-token
    chunks (the 32-token join multiplies factors of both halves)."""
    from k3.ops.kda import chunk as tc

    monkeypatch.setitem(tc.TUNING, "prefill_chunk", chunk)
    lengths = [1, 0, 2, 16, 64, 3, 1, 70, 17]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    inputs = make_raw(1, cu[-1], 2, 16, 32, seed=52, N=len(lengths), bias=30.0)
    z = inputs[3].float()
    z[:, ::3] = 1e4
    z[:, 1::4] = -1e4
    inputs[3] = z.to(inputs[3].dtype)
    out = _infer(inputs, dev, gate_lower_bound=g_min, cu_seqlens=torch.tensor(cu, device=dev))
    _check_forward(out, reference(*inputs, g_min=g_min, cu_seqlens=torch.tensor(cu)), torch.bfloat16, g_min)
    inputs[3] = torch.full_like(inputs[3], 1e4)  # every g = g_min
    out = _infer(inputs, dev, gate_lower_bound=g_min, cu_seqlens=torch.tensor(cu, device=dev))
    _check_forward(out, reference(*inputs, g_min=g_min, cu_seqlens=torch.tensor(cu)), torch.bfloat16, g_min)


def test_segment_bounds_cover_every_chunk_once_at_even_cuts():
    from k3.ops.kda.chunk_prefill import segment_bounds

    for n_chunks in range(0, 40):
        for segments in (1, 2, 3, 4, 7, 64):
            bounds = segment_bounds(n_chunks, segments)
            assert [c for lo, hi in bounds for c in range(lo, hi)] == list(range(n_chunks))
            assert all(lo % 2 == 0 for lo, _ in bounds) and len(bounds) <= segments
            if n_chunks >= 2 * segments:
                assert len(bounds) == segments and max(hi - lo for lo, hi in bounds) <= -(-n_chunks // segments) + 2
    # shorter segments after the regular ones (TUNING's prefill_segment_tail): sizes in proportion, to a chunk pair
    for n_chunks in range(0, 40):
        for segments, tail in ((4, [0.5, 0.25]), (2, [0.3]), (1, [1.0])):
            bounds = segment_bounds(n_chunks, segments, tail)
            assert [c for lo, hi in bounds for c in range(lo, hi)] == list(range(n_chunks))
            assert all(lo % 2 == 0 for lo, _ in bounds) and len(bounds) <= segments + len(tail)
    sizes = [hi - lo for lo, hi in segment_bounds(512, 4, [0.5, 0.25])]
    assert sizes == [108, 108, 108, 108, 54, 26]
    with pytest.raises(ValueError, match="positive"):
        segment_bounds(512, 4, [0.5, 0])


def test_prefill_pipeline_and_dispatch_rules(monkeypatch):
    """The pipeline: one segment per prefill_segment_tokens tokens, at most prefill_segments, for one sequence whose
    state pass fits in one wave and has at least prefill_pipeline_min_work token-heads; else none. From
    prefill_tail_min_programs state programs (None: more than SMs), one per prefill_tail_segment_tokens tokens and
    then the shorter prefill_segment_tail. The inference kernels: from prefill_min_programs programs, or from fewer
    with enough token-heads (`prefill_few_programs`, whose last tier only as a pipeline)."""
    from k3.ops.kda import chunk as tc
    from k3.ops.kda import chunk_prefill as tp
    from k3.ops.kda.chunk_common import plan_for

    device = torch.device("cpu")
    one = plan_for((0, 16384), device, 64)
    two = plan_for((0, 8192, 16384), device, 64)
    monkeypatch.setitem(tc.TUNING, "prefill_segments", 4)
    monkeypatch.setitem(tc.TUNING, "prefill_segment_tokens", 2048)
    monkeypatch.setitem(tc.TUNING, "prefill_pipeline_min_work", 2 ** 15)
    monkeypatch.setitem(tc.TUNING, "prefill_pipeline_max_programs", 8)
    monkeypatch.setitem(tc.TUNING, "prefill_tail_min_programs", 10 ** 6)
    assert tp.prefill_segments_for(one, 4, 128, device) == (4, ())  # 4 · 128/64 = 8 programs, 2^16 token-heads
    assert tp.prefill_segments_for(one, 5, 128, device) == (1, ())  # 10 programs
    assert tp.prefill_segments_for(two, 2, 128, device) == (1, ())  # two sequences would take turns
    monkeypatch.setitem(tc.TUNING, "prefill_segment_tokens", 5000)
    assert tp.prefill_segments_for(one, 4, 128, device) == (3, ())
    monkeypatch.setitem(tc.TUNING, "prefill_pipeline_min_work", 2 ** 16 + 1)
    assert tp.prefill_segments_for(one, 4, 128, device) == (1, ())
    monkeypatch.setitem(tc.TUNING, "prefill_pipeline_max_programs", None)  # two per SM
    monkeypatch.setitem(tc.TUNING, "prefill_pipeline_min_work", 0)
    assert tp.prefill_segments_for(one, 2 * tp._sm_count(device), 64, device) == (3, ())
    assert tp.prefill_segments_for(one, 2 * tp._sm_count(device) + 1, 64, device) == (1, ())
    # the tail: from more state programs than SMs (None), longer regular segments, then the shorter ones
    monkeypatch.setitem(tc.TUNING, "prefill_tail_min_programs", None)
    monkeypatch.setitem(tc.TUNING, "prefill_tail_segment_tokens", 8192)
    monkeypatch.setitem(tc.TUNING, "prefill_segment_tail", [0.5, 0.25])
    assert tp.prefill_segments_for(one, tp._sm_count(device), 64, device) == (3, ())
    assert tp.prefill_segments_for(one, tp._sm_count(device) + 1, 64, device) == (2, (0.5, 0.25))
    monkeypatch.setitem(tc.TUNING, "prefill_tail_segment_tokens", 16384)
    assert tp.prefill_segments_for(one, 2 * tp._sm_count(device), 64, device) == (1, (0.5, 0.25))
    monkeypatch.setitem(tc.TUNING, "prefill_segment_tokens", 16384)  # no pipeline, no tail
    assert tp.prefill_segments_for(one, 2 * tp._sm_count(device), 64, device) == (1, ())
    monkeypatch.setitem(tc.TUNING, "prefill_segment_tokens", 5000)
    monkeypatch.setitem(tc.TUNING, "prefill_tail_min_programs", 300)
    assert tp.prefill_segments_for(one, 2 * tp._sm_count(device), 64, device) == (3, ())

    long = plan_for((0, 65536), device, 64)
    monkeypatch.setitem(tc.TUNING, "prefill_min_programs", 128)
    monkeypatch.setitem(tc.TUNING, "prefill_few_programs", [[8, 2 ** 16, False], [4, 2 ** 18, True]])
    assert tp.prefill_applies(two, 32, 128, device)  # 128 programs
    assert not tp.prefill_applies(two, 2, 128, device)  # 8 programs, 2^15 token-heads
    assert tp.prefill_applies(two, 4, 128, device)  # 16 programs, 2^16
    assert tp.prefill_applies(long, 4, 64, device)  # 4 programs, 2^18, pipelined (4 segments)
    monkeypatch.setitem(tc.TUNING, "prefill_chunk32_max_programs", 3)
    assert not tp.prefill_applies(long, 4, 64, device)  # the tiers only where the chunks are 32 tokens
    monkeypatch.setitem(tc.TUNING, "prefill_chunk32_max_programs", 64)
    monkeypatch.setitem(tc.TUNING, "prefill_pipeline_max_programs", 3)
    assert not tp.prefill_applies(long, 4, 64, device)  # the same, not pipelined
    monkeypatch.setitem(tc.TUNING, "prefill", False)
    assert not tp.prefill_applies(two, 32, 128, device)


def test_prefill_dispatch_does_not_depend_on_the_launch_value_block(monkeypatch):
    """The dispatch thresholds were measured at BV 64 and count programs at BV 64 (`_state_programs`): whichever
    value block the state pass launches with, every shape takes the same path, chunk and segments."""
    from k3.ops.kda import chunk as tc
    from k3.ops.kda import chunk_prefill as tp
    from k3.ops.kda.chunk_common import plan_for

    device = torch.device("cpu")
    plans = [plan_for(offsets, device, 64) for offsets in
             ((0, 8192), (0, 32768), (0, 65536), (0, 8192, 16384), (0, 1300, 1847, 3895, 4858, 5129, 8192))]
    shapes = [(plan, H, V) for plan in plans for H in (1, 8, 16, 32, 64, 96) for V in (64, 128)]

    def decisions():
        return [(tp.prefill_applies(*shape, device), tp.prefill_chunk_for(*shape, device),
                 tp.prefill_segments_for(*shape, device)) for shape in shapes]

    monkeypatch.setitem(tc.TUNING, "prefill_state_bv", 64)
    at_64 = decisions()
    assert len(set(at_64)) > 3  # the shapes reach several paths
    for bv in (32, 128):
        monkeypatch.setitem(tc.TUNING, "prefill_state_bv", bv)
        assert decisions() == at_64, bv


@pytest.mark.parametrize("chunk", [16, 32])
def test_prefill_pipeline_segments_give_the_same_results(dev, monkeypatch, chunk):
    """The inference forward as a pipeline of segments (`prefill_segments`: each segment's state pass after its
    prepare, beside the next one's; on a GPU on two streams) gives bit-identical o, final states and chunk-start
    states: packed documents that start, end and lie wholly inside segments, empty ones, and an initial state."""
    from k3.ops.kda import chunk as tc
    from k3.ops.kda import chunk_kda
    from k3.ops.kda import chunk_prefill as tp

    monkeypatch.setitem(tc.TUNING, "prefill_chunk", chunk)
    # segments at any size and packing (the rule pipelines one long sequence only; the kernels cut any packing)
    monkeypatch.setattr(tp, "prefill_segments_for",
                        lambda *a: (tc.TUNING["prefill_segments"], tuple(tc.TUNING["prefill_segment_tail"])))
    lengths = [0, 70, 1, 0, 130, 17, 33, 0]
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], device=dev)
    inputs = make_raw(1, int(cu[-1]), 2, 32, 32, seed=56, N=len(lengths))
    outs = []
    # (segments, prefill_segment_tail); at 64 (two chunks each) documents start, end and lie wholly inside segments
    splits = ((1, []), (2, []), (64, []), (2, [0.5, 0.25])) + repeats((3, []), (5, []))
    for segments, tail in splits:
        monkeypatch.setitem(tc.TUNING, "prefill_segments", segments)
        monkeypatch.setitem(tc.TUNING, "prefill_segment_tail", tail)
        outs.append(_infer(inputs, dev, cu_seqlens=cu, return_chunk_states=True))
    for split, out in zip(splits[1:], outs[1:]):
        for a, b in zip(outs[0], out):
            assert torch.equal(a, b), split
    monkeypatch.setitem(tc.TUNING, "prefill_segment_tail", [])
    _check_forward(outs[0][:2], reference(*inputs, cu_seqlens=cu.cpu()), torch.bfloat16, "segments")
    monkeypatch.setitem(tc.TUNING, "prefill_segments", 4)
    no_state = [t.to(dev) for t in inputs]
    with torch.no_grad():  # without a final state the segments keep theirs in scratch
        o, _ = chunk_kda(*no_state[:7], initial_state=no_state[7], cu_seqlens=cu)
    assert torch.equal(o, outs[0][0])


def test_prefill_forward_head_dims_value_blocks_and_bf16_products(dev, monkeypatch):
    """K = V = 128 (the model's head), V = 64, each launched with TUNING's value block and a warpgroup per 64 value
    columns (at least one); V split into value blocks of 16 (the value columns are independent: the same results up
    to a product's summation order), and `state_bf16` (plain bf16 products) within the bf16 limits."""
    from k3.ops.kda import chunk as tc

    launched = []
    state = tc.prefill_forward.__globals__["_prefill_state"]

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append((grid, kw["num_warps"])) or state[grid](*a, **kw)

    monkeypatch.setitem(tc.prefill_forward.__globals__, "_prefill_state", Spy())
    inputs = make_raw(1, 40, 1, 128, 128, seed=53, bias=2.0)
    monkeypatch.setitem(tc.TUNING, "prefill_state_bv", 128)
    _check_forward(_infer(inputs, dev), reference(*inputs), torch.bfloat16, "K = V = 128, BV 128")
    monkeypatch.setitem(tc.TUNING, "prefill_state_bv", 64)
    _check_forward(_infer(inputs, dev), reference(*inputs), torch.bfloat16, "K = V = 128, BV 64")
    assert launched == [((1, 1), 8), ((2, 1), 4)], launched  # (value blocks, N·H), warps; one segment
    inputs = make_raw(1, 70, 2, 32, 64, seed=54, dtype=torch.float32)
    base = _infer(inputs, dev)
    monkeypatch.setitem(tc.TUNING, "prefill_state_bv", 16)
    narrow = _infer(inputs, dev)
    assert launched[2:] == [((1, 2), 4), ((4, 2), 4)], launched
    for a, b in zip(base, narrow):
        torch.testing.assert_close(a, b, rtol=5e-5, atol=1e-5)
    inputs = make_raw(2, 100, 2, 32, 32, seed=55)
    _check_forward(_infer(inputs, dev, state_bf16=True), reference(*inputs), torch.bfloat16, "state_bf16")


@pytest.mark.parametrize("chunk", (16, 32))
def test_prefill_forward_state_products_and_inverse_precision(dev, monkeypatch, chunk):
    """The inference forward's defaults for bf16 inputs (plain bf16 state products, tf32 inverses) and the exact
    settings (split products, FMA inverses), each within the bf16 limits against fp64 at lengths around the chunk
    edges; fp32 inputs always take the exact inverse; a precision the kernels do not know is refused."""
    from k3.ops.kda import chunk as tc
    from k3.ops.kda.chunk_common import _inverse_precision

    monkeypatch.setitem(tc.TUNING, "prefill_chunk", chunk)
    inputs = make_raw(2, 47, 2, 32, 32, seed=56)
    _check_forward(_infer(inputs, dev), reference(*inputs), torch.bfloat16, (chunk, "defaults"))
    monkeypatch.setitem(tc.TUNING, "prefill_state_bf16", False)
    monkeypatch.setitem(tc.TUNING, "prefill_inverse", "ieee")
    _check_forward(_infer(inputs, dev), reference(*inputs), torch.bfloat16, (chunk, "exact"))
    monkeypatch.setitem(tc.TUNING, "prep_inverse", "ieee")
    assert _inverse_precision("prep", torch.bfloat16) == "ieee"
    monkeypatch.setitem(tc.TUNING, "prep_inverse", "tf32")
    assert _inverse_precision("prep", torch.float16) == "tf32"
    assert _inverse_precision("prep", torch.float32) == "ieee"
    monkeypatch.setitem(tc.TUNING, "prefill_inverse", "fp16")
    with pytest.raises(ValueError, match="prefill_inverse"):
        _infer(inputs, dev)


def test_kernel_precisions_follow_the_input_dtype(dev, monkeypatch):
    """What the launches receive: bf16 and fp16 inputs get tf32 inverses (inference prepare and training
    `_prep_intra`) and plain bf16 state products in the inference forward; fp32 inputs get exact inverses and split
    products. (The interpreter computes tf32 dots exactly, so only the launch arguments can tell.)"""
    from k3.ops.kda import chunk_prefill as tp
    from k3.ops.kda import chunk_prepare

    seen = []

    def spy(module, name):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, type("Spy", (), {"__getitem__": lambda self, grid: (
            lambda *a, **k: seen.append((name, {x: k[x] for x in ("INVERSE", "BF16", "SPLIT") if x in k}))
            or kernel[grid](*a, **k))})())

    for module, name in ((tp, "_prefill_prepare"), (tp, "_prefill_state"), (chunk_prepare, "_prep_intra")):
        spy(module, name)
    want = {torch.bfloat16: ("tf32", True), torch.float16: ("tf32", True), torch.float32: ("ieee", False)}
    for dtype, (inverse, bf16) in want.items():
        inputs = make_raw(1, 20, 1, 16, 16, seed=59, dtype=dtype)
        seen.clear()
        _infer(inputs, dev)
        _fwd_bwd(inputs, dev)
        got = dict(seen)
        assert got["_prefill_prepare"] == {"INVERSE": inverse}, (dtype, seen)
        assert got["_prefill_state"] == {"BF16": bf16, "SPLIT": not bf16}, (dtype, seen)
        assert got["_prep_intra"] == {"INVERSE": inverse}, (dtype, seen)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's σ(±1e4)
def test_prefill_forward_32_token_chunks(dev, monkeypatch):
    """`TUNING["prefill_chunk"]` 32 (two launches of `_prefill_prepare`, one per chunk half; at or below 64 state
    programs by default) against fp64 at lengths around 32 and 64, bf16 and fp32, beside the 16-token chunks (fp32:
    2e-5 in the interpreter); packed documents with every decay at the bound, where G reaches −160 inside a chunk;
    the states for prefix caching (every second 32-token chunk)."""
    from k3.ops.kda import chunk as tc

    # (150: more chunks of the kinds 31 and 65 end in)
    for T, dtype in ((1, torch.float32), (31, torch.bfloat16), (33, torch.float32), (65, torch.bfloat16),
                     *repeats((150, torch.float32))):
        inputs = make_raw(2, T, 2, 32, 32, seed=60 + T, dtype=dtype)
        monkeypatch.setitem(tc.TUNING, "prefill_chunk", 16)
        out16 = _infer(inputs, dev)
        monkeypatch.setitem(tc.TUNING, "prefill_chunk", 32)
        out = _infer(inputs, dev)
        _check_forward(out, reference(*inputs), dtype, (T, dtype))
        if dtype == torch.float32 and not ON_GPU:
            assert rel_err(out[0], out16[0]) <= 2e-5 and rel_err(out[1], out16[1]) <= 2e-5, T
    lengths = [1, 0, 32, 3, 70, 33]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    inputs = make_raw(1, cu[-1], 2, 16, 32, seed=61, N=len(lengths))
    inputs[3] = torch.full_like(inputs[3], 1e4)  # every g = −5
    cu_dev = torch.tensor(cu, device=dev)
    out = _infer(inputs, dev, cu_seqlens=cu_dev)
    _check_forward(out, reference(*inputs, cu_seqlens=torch.tensor(cu)), torch.bfloat16, "varlen at the bound")
    x = [t.to(dev) for t in inputs]
    with torch.no_grad():
        _, _, hs = tc.chunk_kda(*x[:7], initial_state=x[7], cu_seqlens=cu_dev, return_chunk_states=True)
        monkeypatch.setitem(tc.TUNING, "prefill_chunk", 16)
        _, _, hs16 = tc.chunk_kda(*x[:7], initial_state=x[7], cu_seqlens=cu_dev, return_chunk_states=True)
    assert hs.shape == hs16.shape and rel_err(hs.cpu(), hs16.cpu()) <= 5e-3


def test_prefill_applies_with_enough_programs(dev, monkeypatch):
    """chunk_kda's inference forward is `chunk_prefill`'s where its state pass has at least prefill_min_programs
    (value block, sequence, head) programs, else the 64-token one; a training forward never is."""
    from k3.ops.kda import chunk as tc

    prefills = []
    prefill_forward = tc.prefill_forward
    monkeypatch.setattr(tc, "prefill_forward", lambda *a, **k: prefills.append(1) or prefill_forward(*a, **k))
    inputs = make_raw(2, 20, 2, 32, 64, seed=56)  # N·H = 4 sequences and heads; V = 64: one value block of 64
    for threshold, want in ((4, 1), (5, 0)):
        monkeypatch.setitem(tc.TUNING, "prefill_min_programs", threshold)
        prefills.clear()
        _infer(inputs, dev)
        assert len(prefills) == want, threshold
    monkeypatch.setitem(tc.TUNING, "prefill_min_programs", 0)
    prefills.clear()
    tc.chunk_kda(*(x.to(dev).requires_grad_() for x in inputs[:7]))
    assert prefills == []


def test_prefill_chunk_32_while_the_state_pass_fits_one_wave(dev, monkeypatch):
    """32-token chunks while the state pass's (value block, sequence, head) programs fit in one wave (latency-bound:
    half the sequential steps), 16 beyond (throughput-bound); `prefill_chunk` 16 always 16, anything else refused.
    The inference forward launches the prepare twice (two halves) at 32 and once at 16."""
    from k3.ops.kda import chunk as tc
    from k3.ops.kda import chunk_prefill as tp
    from k3.ops.kda.chunk_common import plan_for

    device = torch.device(dev)
    plan = plan_for((0, 100, 300), device, 64)  # N = 2
    monkeypatch.setitem(tc.TUNING, "prefill_chunk", 32)
    monkeypatch.setitem(tc.TUNING, "prefill_chunk32_max_programs", 8)
    assert tp.prefill_chunk_for(plan, 2, 128, device) == 32  # 2 · 2 · 128/64 = 8 programs
    assert tp.prefill_chunk_for(plan, 3, 128, device) == 16  # 12
    monkeypatch.setitem(tc.TUNING, "prefill_chunk32_max_programs", None)  # two per SM
    assert tp.prefill_chunk_for(plan, 2 * tp._sm_count(device), 64, device) == 16
    assert tp.prefill_chunk_for(plan, tp._sm_count(device), 64, device) == 32
    monkeypatch.setitem(tc.TUNING, "prefill_chunk", 16)
    assert tp.prefill_chunk_for(plan, 2, 128, device) == 16
    monkeypatch.setitem(tc.TUNING, "prefill_chunk", 64)
    with pytest.raises(ValueError, match="16 or 32"):
        tp.prefill_chunk_for(plan, 2, 128, device)
    monkeypatch.setitem(tc.TUNING, "prefill_chunk", 32)
    halves = []
    prepare = tp._prefill_prepare
    monkeypatch.setattr(tp, "_prefill_prepare", type("Spy", (), {"__getitem__": lambda self, grid: (
        lambda *a, **k: halves.append(k["HALF"]) or prepare[grid](*a, **k))})())
    inputs = make_raw(2, 20, 2, 32, 64, seed=57)  # N·H = 4 programs
    monkeypatch.setitem(tc.TUNING, "prefill_segments", 1)  # one prepare launch (or pair) in all
    for limit, want in ((4, [1, 2]), (3, [0])):
        monkeypatch.setitem(tc.TUNING, "prefill_chunk32_max_programs", limit)
        halves.clear()
        _check_forward(_infer(inputs, dev), reference(*inputs), torch.bfloat16, limit)
        assert halves == want, limit


@pytest.mark.parametrize("prefill", [True, False])
def test_saved_intermediates_only_when_a_backward_follows(dev, monkeypatch, prefill):
    """No grad mode or no input that requires grad: nothing extra is computed or kept. With `prefill` (the default)
    such a forward runs the inference kernels of `chunk_prefill` alone, none of the training forward's."""
    from k3.ops.kda import chunk as tc
    from k3.ops.kda import chunk_kda

    monkeypatch.setitem(tc.TUNING, "prefill", prefill)
    prefills = []
    prefill_forward = tc.prefill_forward
    monkeypatch.setattr(tc, "prefill_forward", lambda *a, **k: prefills.append(1) or prefill_forward(*a, **k))
    calls = []
    prepare, state = tc._fwd_prepare, tc._fwd_state
    monkeypatch.setattr(tc, "_fwd_prepare", lambda *a, **k: calls.append(k) or prepare(*a, **k))
    monkeypatch.setattr(tc, "_fwd_state", lambda *a, **k: calls.append(k) or state(*a, **k))
    inputs = [x.to(dev) for x in make_raw(1, 70, 2, 32, 32, seed=24)]
    with torch.no_grad():
        o, _ = chunk_kda(*(x.clone().requires_grad_() for x in inputs[:7]), save_intermediates=True)
    o2, _ = chunk_kda(*inputs[:7], save_intermediates=True)
    assert o.grad_fn is None and o2.grad_fn is None and torch.equal(o, o2)
    if prefill:
        assert calls == [] and len(prefills) == 2, calls
    else:
        assert len(calls) == 4 and not any(k.get("store_t") or k.get("want_hs") or k.get("want_ut") for k in calls), \
            calls
    prefills.clear()
    # switched off, a training forward keeps nothing and the backward recomputes (Ũ included)
    calls.clear()
    leaves = [x.clone().requires_grad_() for x in inputs[:7]]
    chunk_kda(*leaves, save_intermediates=False)[0].sum().backward()
    assert len(calls) == 4 and not calls[0].get("store_t") and not calls[1].get("want_ut") and calls[3]["want_ut"]
    assert prefills == []


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


@pytest.mark.parametrize("prefill,chunk", [(True, 16), (True, 32), (False, 16)])
def test_chunk_states_for_prefix_caching(dev, monkeypatch, prefill, chunk):
    """The states at every 64-token chunk start (chunk_kda's return_chunk_states), from the inference forward in
    16-token chunks (every fourth of its chunks) and 32-token ones (every second), and from the 64-token one."""
    from k3.ops.kda import chunk as tc
    from k3.ops.kda import chunk_kda

    monkeypatch.setitem(tc.TUNING, "prefill", prefill)
    monkeypatch.setitem(tc.TUNING, "prefill_chunk", chunk)
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
    --tuning sweeps them); warps always do, as set or, where None, from the value block."""
    pytest.importorskip("triton")
    from k3.ops.kda import chunk as tc

    monkeypatch.setitem(tc.TUNING, "prep_intra_maxnreg", 168)
    monkeypatch.setitem(tc.TUNING, "prep_intra_stages", None)
    assert tc._launch_options("prep_intra") == {"num_warps": tc.TUNING["prep_intra_warps"], "maxnreg": 168}
    assert tc._launch_options("state") == {"num_warps": tc.TUNING["state_warps"],
                                           "num_stages": tc.TUNING["state_stages"]}
    monkeypatch.setitem(tc.TUNING, "bwd_k_stages", 3)
    monkeypatch.setitem(tc.TUNING, "bwd_k_maxnreg", None)
    assert tc._launch_options("bwd_k")["num_stages"] == 3 and "maxnreg" not in tc._launch_options("bwd_k")
    # warps None: a warpgroup per 64 value columns of the launch's value block, at least one
    monkeypatch.setitem(tc.TUNING, "prefill_state_warps", None)
    assert [tc._launch_options("prefill_state", bv)["num_warps"] for bv in (16, 64, 128, 256)] == [4, 4, 8, 16]
    with pytest.raises(ValueError, match="value block"):
        tc._launch_options("prefill_state")


# the prepare (`_prep_gate`, `_prep_intra`, `_prep_solve`, `_prep_wu`) against the chunk operands in fp64

PREPARE_CASES = {
    # name: (document lengths, H, K, V, input dtype, all_bf16, g_min); V = 128 gives `_prep_wu` two U slices;
    # 40: a partial 16-row block whose anchor G is below −88 (exp(−G) overflows fp32; padded rows must not use it)
    "dense_bf16": ([65, 65], 1, 32, 32, torch.bfloat16, False, -5.0),
    "varlen_bf16_K16_V128": ([1, 17, 0, 65, 130], 1, 16, 128, torch.bfloat16, False, -5.0),
    "varlen_all_bf16": ([130, 1, 17], 2, 32, 32, torch.bfloat16, True, -0.1),
    "dense_fp32": ([70], 2, 32, 32, torch.float32, False, -1.0),
    "varlen_fp32": ([0, 1, 17, 40, 65, 130], 2, 32, 32, torch.float32, False, -5.0),
}
PREPARED = ("W", "U", "Qg", "Kd", "Aqk", "gc", "T")  # `_fwd_prepare`'s outputs, in order


def chunk_operands_fp64(q, k, v, z, b, A_log, dt_bias, g_min, scale, offsets, C=64):
    """`_fwd_prepare`'s outputs in fp64 from [TT, H, ·] inputs, document by document: W, U, Q⊙Γ, K⊙exp(G_C − G),
    Aqk, G_C, T = (I + Akk)⁻¹ (the direct scores of `k3.ops.kda.reference`, never factorised)."""
    from k3.ops.kda.reference import _direct_scores

    outs = {name: [] for name in PREPARED}
    for s, e in zip(offsets[:-1], offsets[1:]):
        L = e - s
        if L == 0:
            continue
        NT = -(-L // C)
        qd, kd, vd, zd, bd = (x[s:e].double() for x in (q, k, v, z, b))
        qn = qd / torch.sqrt((qd * qd).sum(-1, keepdim=True) + 1e-6) * scale
        kn = kd / torch.sqrt((kd * kd).sum(-1, keepdim=True) + 1e-6)
        g = naive_kda_gate(zd, A_log.double(), dt_bias.double(), g_min)
        beta = torch.sigmoid(bd)[..., None]

        def chunks(x):  # [L, H, ·] → [H, NT, C, ·], zero rows past the end (g = β = 0 there)
            x = F.pad(x, (0, 0, 0, 0, 0, NT * C - L))
            return x.transpose(0, 1).reshape(x.shape[1], NT, C, -1)

        qc, kc, vc, gcum, bc = chunks(qn), chunks(kn), chunks(vd), chunks(g).cumsum(-2), chunks(beta)
        Akk, Aqk = _direct_scores(qc, kc, bc, gcum)
        eye = torch.eye(C, dtype=F64)
        T = torch.linalg.solve_triangular(eye + Akk, eye.expand_as(Akk), upper=False, unitriangular=True)
        gam = gcum.exp()

        def rows(x):  # [H, NT, C, ·] → [L, H, ·]
            return x.reshape(x.shape[0], NT * C, -1)[:, :L].transpose(0, 1)

        outs["W"].append(rows(T @ (bc * kc * gam)))
        outs["U"].append(rows(T @ (bc * vc)))
        outs["Qg"].append(rows(qc * gam))
        outs["Kd"].append(rows(kc * (gcum[..., -1:, :] - gcum).exp()))
        outs["Aqk"].append(rows(Aqk))
        outs["gc"].append(gcum[..., -1, :].transpose(0, 1))  # [NT, H, K]; padded rows have g = 0
        outs["T"].append(rows(T))
    return [torch.cat(outs[name]) for name in PREPARED]


@pytest.mark.parametrize("case", list(PREPARE_CASES))
def test_prepare_matches_fp64_chunk_operands(dev, case):
    """`_fwd_prepare` (store_t) against the chunk operands in fp64 on the same (rounded) inputs: shapes, dtypes
    and layouts as `inter_dtypes` says, T's and Aqk's upper triangles exactly zero (`_state`, `_state_bwd` and
    the backward read them as 64×64 tiles), and values within, relative RMSE: for fp32 inputs 5e-6 in the
    interpreter (exact fp32; measured ≤ 6.0e-7, Aqk and K⊙exp(G_C − G), where |G| reaches 320 and its fp32
    rounding moves the exponentials) and 7.5e-3 on a GPU (1.5× the bf16 bound, the file's rule for tf32 dots;
    not measured yet); for bf16 inputs 5e-3 (as the output's): W, Q⊙Γ and K⊙exp(G_C − G) are stored in bf16 and
    the score blocks multiply bf16 operands (measured ≤ 2.7e-3, Aqk with all_bf16; T ≤ 6.5e-4; U 1e-4 unless
    all_bf16 stores it in bf16). The cases at g_min −5 cover `_intra_off_step`'s one anchor per row block, whose
    factors exp(a_R − G) underflow to zero across up to 48 rows (measured: the same errors as the two-anchor
    factorisation it replaced, ±1e-8)."""
    from k3.ops.kda import chunk as tc
    from k3.ops.kda.chunk_common import _Plan

    lengths, H, K, V, dtype, all_bf16, g_min = PREPARE_CASES[case]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    q, k, v, z, b, A_log, dt_bias, _ = (x.to(dev) for x in make_raw(1, offsets[-1], H, K, V, seed=31, N=1,
                                                                    dtype=dtype, bias=2.0))
    q, k, v, z, b = (x[0] for x in (q, k, v, z, b))
    plan = _Plan(tuple(offsets), torch.device(dev))
    dtypes = tc.inter_dtypes(dtype, all_bf16)
    out = tc._fwd_prepare(q, k, v, z, b, A_log, dt_bias, g_min, K ** -0.5, plan, dtypes, store_t=True)
    ref = chunk_operands_fp64(*(x.cpu() for x in (q, k, v, z, b, A_log, dt_bias)), g_min, K ** -0.5, offsets)
    lo, hi = dtypes
    want_dtypes = {"W": lo, "U": hi, "Qg": lo, "Kd": lo, "Aqk": hi, "gc": torch.float32, "T": torch.float32}
    errs = {}
    for name, a, r in zip(PREPARED, out, ref):
        assert a.dtype == want_dtypes[name] and a.is_contiguous(), name
        assert a.shape == ((plan.NT,) if name == "gc" else (offsets[-1],)) + r.shape[1:], (name, a.shape, r.shape)
        assert torch.isfinite(a).all(), name
        errs[name] = rel_err(a.cpu(), r)
    tol = 5e-3 if dtype == torch.bfloat16 else (7.5e-3 if ON_GPU else 5e-6)
    assert all(e <= tol for e in errs.values()), (case, errs)
    # T's and Aqk's upper triangles: exact zeros
    for name in ("T", "Aqk"):
        x = out[PREPARED.index(name)].cpu()
        for s, e in zip(offsets[:-1], offsets[1:]):
            for c0 in range(s, e, 64):
                rows = torch.arange(min(64, e - c0))
                upper = rows[:, None] < torch.arange(64)[None, :]
                assert (x[c0: c0 + len(rows)][upper[:, None, :].expand(-1, H, -1)] == 0).all(), (name, c0)
    # without store_t, T is not returned
    assert tc._fwd_prepare(q, k, v, z, b, A_log, dt_bias, g_min, K ** -0.5, plan, dtypes)[6] is None


# the backward over key slices: `_bwd_vk` (value side, slices of TUNING["bwd_vk_cols"]) + `_bwd_vv`, and
# `_bwd_k_block` (slices of TUNING["bwd_k_cols"]) + `_bwd_gate` + `_bwd_norms`

SLICE_CASES = {
    # name: (document lengths or None for a dense [2, 70] batch, H, K, V, input dtype, bwd_vk_cols, bwd_k_cols,
    # extra chunk_kda arguments); the main tests run one slice of each at K = 32
    "dense_fp32": (None, 2, 32, 32, torch.float32, 16, 16, {}),
    "dense_bf16": (None, 2, 32, 32, torch.bfloat16, 16, 16, {}),
    "varlen_fp32_V64": ([0, 1, 17, 65, 130], 1, 32, 64, torch.float32, 16, 16, {}),
    "varlen_fp32_bwd_k_2slices": ([1, 0, 17, 70], 1, 32, 32, torch.float32, 32, 16, {}),
    "K64_bf16": ([130], 1, 64, 32, torch.bfloat16, 32, 32, {}),
    "varlen_bf16_K16_V128": ([1, 17, 0, 65, 130], 1, 16, 128, torch.bfloat16, 16, 16, {}),
    "varlen_all_bf16": ([130, 1, 17, 0, 65], 2, 32, 32, torch.bfloat16, 16, 32, {"all_bf16": True}),
    "recompute_fp32": (None, 2, 32, 32, torch.float32, 16, 16, {"save_intermediates": False}),
    "recompute_varlen_bf16": ([0, 1, 17, 65, 130], 1, 32, 32, torch.bfloat16, 16, 16, {"save_intermediates": False}),
}


# all_bf16 only changes what the kernels load and store (varlen, two value-side slices: recompute_varlen_bf16)
@pytest.mark.parametrize("case", cases(*SLICE_CASES, gpu_only=("recompute_fp32", "dense_bf16", "varlen_fp32_V64",
                                                             "varlen_bf16_K16_V128", "varlen_all_bf16")))
def test_backward_key_slices(dev, monkeypatch, case):
    """Every gradient of `chunk_kda` with the backward split into several key slices against the fp64 recurrence
    at the file's tolerances (initial state and dht included), and against one slice per kernel (bwd_vk_cols =
    bwd_k_cols = K). The slices do the same per-column arithmetic; only the sums over K run in another order:
    dβ (`_bwd_vk`'s partials, added in `_bwd_vv`), dβ again (`_bwd_k_block`'s partials, in `_bwd_norms`) and
    dA_log (over the slices' partial sums). Tolerance, relative RMSE, in the interpreter: 1e-5 for fp32 inputs
    (measured ≤ 1.2e-6, dA_log; the rest ≤ 4.9e-7) and 1e-4 for bf16 inputs, whose gradients are stored in bf16:
    an fp32 difference of ~1e-7 can flip a rounding by one bf16 ulp (measured: dq 2.3e-5 in dense_bf16, three
    such flips among its 8960 entries; dk 1.8e-5 with all_bf16, dz ≤ 2.8e-6, the rest ≤ 2.5e-6). On a GPU
    1e-3 (other dot tilings; measured on an H200: dz 2.1e-4 and dt_bias 1.1e-4). Outputs are bit-identical. At
    K = 16 both sides are one slice."""
    import functools

    import k3.ops.kda
    from k3.ops.kda import chunk as tc

    lengths, H, K, V, dtype, vk_cols, k_cols, kw = SLICE_CASES[case]
    if lengths is None:
        inputs, cu = make_raw(2, 70, H, K, V, seed=41, dtype=dtype), None
    else:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        inputs = make_raw(1, cu[-1], H, K, V, seed=41, N=len(lengths), dtype=dtype)
    monkeypatch.setattr(k3.ops.kda, "chunk_kda", functools.partial(tc.chunk_kda, **kw))
    runs = {}
    for sliced in (True, False):
        monkeypatch.setitem(tc.TUNING, "bwd_vk_cols", vk_cols if sliced else K)
        monkeypatch.setitem(tc.TUNING, "bwd_k_cols", k_cols if sliced else K)
        runs[sliced] = run_both([x.clone() for x in inputs], dev, cu_seqlens=cu)
        if min(vk_cols, k_cols) >= K:
            break
    check(*runs[True], dtype, case)
    if False not in runs:
        return
    (o, S, grads), _ = runs[True]
    (ro, rS, rgrads), _ = runs[False]
    assert torch.equal(o, ro) and torch.equal(S, rS)
    tol = 1e-3 if ON_GPU else (1e-5 if dtype == torch.float32 else 1e-4)
    for name, a, r in zip(NAMES, grads, rgrads):
        assert torch.isfinite(a).all(), name
        assert rel_err(a.cpu(), r.cpu()) <= tol, (case, name, rel_err(a.cpu(), r.cpu()))



# the row norms ‖q‖, ‖k‖ the prepare keeps for the backward (`_load_norm` in `_bwd_vk`, `_bwd_k_block`, `_bwd_norms`)


@pytest.mark.parametrize("save", cases(True, False, gpu_only=(False,)))
def test_kept_norms_and_gate_are_read(dev, monkeypatch, save):
    """The backward reads the norms and the cumulative gate G the prepare stored, not full-row reloads or a gate of
    its own: scaling the stored ‖q‖ (or ‖k‖), or shifting G, after the prepare leaves o, the final state and dv
    bit-identical and changes dq (dk; dq through exp(G) in `_bwd_vk`). They are stored by the forward that keeps its
    intermediates, or by the backward's recompute (save_intermediates off), and never by an inference forward (G is
    freed before `_state`; the default inference forward, `chunk_prefill`'s, calls no prepare of this file). Two key
    slices in each backward kernel."""
    from k3.ops.kda import chunk as tc

    cu = [0, 1, 1, 18, 88]
    inputs = make_raw(1, cu[-1], 1, 32, 32, seed=43, N=len(cu) - 1, dtype=torch.float32)
    monkeypatch.setitem(tc.TUNING, "bwd_vk_cols", 16)
    monkeypatch.setitem(tc.TUNING, "bwd_k_cols", 16)
    stored, corrupt = [], []
    prepare = tc._fwd_prepare

    def spy(*a, **k):
        out = prepare(*a, **k)
        stored.append(k.get("store_norms", False))
        assert (out[7] is not None) == stored[-1] and (out[8] is not None) == stored[-1]
        for i in corrupt if stored[-1] else ():
            if i < 2:
                out[7][i].mul_(2.0)
            else:
                out[8].add_(0.5)
        return out

    monkeypatch.setattr(tc, "_fwd_prepare", spy)
    kw = dict(cu_seqlens=torch.tensor(cu, device=dev), save_intermediates=save)
    base = _fwd_bwd([x.clone() for x in inputs], dev, **kw)  # fresh leaves per run (CPU .to)
    assert stored == ([True] if save else [False, True]), stored
    for i, name in enumerate(("q", "k", "G")):
        corrupt[:] = [i]
        bad = _fwd_bwd([x.clone() for x in inputs], dev, **kw)
        o, S, dq, dk, dv = (bad[j] for j in (0, 1, 2, 3, 4))
        assert torch.equal(o, base[0]) and torch.equal(S, base[1]) and torch.equal(dv, base[4]), name
        assert rel_err((dq, dk, dq)[i].cpu(), base[(2, 3, 2)[i]].cpu()) > 0.1, name
    stored.clear()
    with torch.no_grad():
        x = [t.to(dev) for t in inputs]
        tc.chunk_kda(*x[:7], initial_state=x[7], cu_seqlens=kw["cu_seqlens"])
    assert stored == ([] if tc.TUNING["prefill"] else [False]), stored
