"""Triton KDA kernels at full shapes on a CUDA GPU (K = V = 128, bf16), against the fp64 recurrence and fla.

Tolerances as in tests/ops/test_kda_triton.py. Where fla-core is importable, our error must
also be at most 1.5× fla's on the same inputs.

Legend: B batch, T tokens, H heads, K key dim, V value dim, N sequences.
"""

import os

import pytest
import torch

from tests.ops.test_kda_triton import NAMES, TOL, make_raw, reference, rel_err

pytestmark = pytest.mark.gpu


def _fla():
    """fla's chunk_kda with one config per autotuner (accuracy does not depend on the config), or None."""
    os.environ.setdefault("FLA_FLASH_KDA", "0")
    from benchmarks.kda import load_fla

    fla = load_fla(max_configs=1)
    return None if fla is None else fla[0]


def _run(fn, inputs, cu=None, grads=True, seed=1):
    ins = [x.cuda().requires_grad_(grads) for x in inputs]
    o, S = fn(ins, cu)
    if not grads:
        return o.detach(), S.detach(), None
    gen = torch.Generator(device="cuda").manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, device="cuda", dtype=torch.float64)
    dS = torch.randn(S.shape, generator=gen, device="cuda", dtype=torch.float64)
    ((o.double() * do).sum() + (S.double() * dS).sum()).backward()
    return o.detach(), S.detach(), [x.grad for x in ins]


def ours(ins, cu):
    from k3.ops.kda import chunk_kda

    return chunk_kda(*ins[:7], initial_state=ins[7], output_final_state=True, cu_seqlens=cu)


def ref64(ins, cu):
    return reference(*ins, cu_seqlens=None if cu is None else cu.cpu())


def fla(ins, cu):
    q, k, v, z, b, A_log, dt_bias, h0 = ins
    return _fla()(q, k, v, z, b, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                  A_log=A_log, dt_bias=dt_bias, cu_seqlens=None if cu is None else cu.long())


def errors(a, ref):
    out = {"o": rel_err(a[0], ref[0]), "S": rel_err(a[1], ref[1])}
    if a[2] is not None:
        out.update({n: rel_err(g, r) for n, g, r in zip(NAMES, a[2], ref[2])})
    return out


def test_forward_full_shape():
    """B=1, T=8192, H=96: output and final state against the fp64 recurrence (computed on the GPU)."""
    inputs = make_raw(1, 8192, 96, 128, 128, seed=0, bias=2.0)
    with torch.no_grad():
        tri = _run(ours, inputs, grads=False)
        ref = _run(ref64, inputs, grads=False)
    e = errors(tri, ref)
    assert e["o"] <= TOL["o"] and e["S"] <= TOL["S"], e


@pytest.mark.parametrize("cu", [None, [0, 1300, 1847, 3895, 4858, 5129, 8192]])
def test_forward_backward_long(cu):
    """T=8192 at H=4 (the fp64 autograd reference must fit), dense and a varlen mix of long, short and one-token documents."""
    N = 1 if cu is None else len(cu) - 1
    inputs = make_raw(1, 8192, 4, 128, 128, seed=1, bias=2.0, N=N)
    cu_t = None if cu is None else torch.tensor(cu, device="cuda", dtype=torch.int32)
    tri = _run(ours, inputs, cu_t)
    ref = _run(ref64, inputs, cu_t)
    e = errors(tri, ref)
    for name, err in e.items():
        assert err <= TOL[name], (name, e)
    if _fla() is not None:
        base = errors(_run(fla, inputs, cu_t), ref)
        for name in e:
            # never worse than 1.5× fla, with a floor at 1e-3 where both are far inside the tolerance
            assert e[name] <= max(1.5 * base[name], 1e-3), (name, e, base)


def test_decode_full_shape():
    from k3.ops.kda import fused_recurrent_kda

    q, k, v, z, b, A_log, dt_bias, _ = make_raw(64, 1, 96, 128, 128, seed=2)
    pool = torch.randn(80, 96, 128, 128, device="cuda")
    idx = torch.randperm(80, device="cuda")[:64]
    before = pool[idx].clone()
    o, _ = fused_recurrent_kda(*(x.cuda() for x in (q, k, v, z, b, A_log, dt_bias)), pool, idx)
    ro, rS = reference(*(x.cuda() for x in (q, k, v, z, b, A_log, dt_bias)), before)
    assert rel_err(o, ro) <= TOL["o"] and rel_err(pool[idx], rS) <= 1e-4


def test_pipelined_forward_in_a_cuda_graph_and_on_another_stream():
    """The inference forward as a pipeline (B=1 T=8192 H=64: 128 state programs, 4 segments on two streams) captured
    in a CUDA graph and replayed, and run on a non-default current stream: both bit-identical to the eager forward on
    the default stream, also after the inputs change in place (the graph reads them at replay); and the same as one
    segment, and within the limits of the fp64 recurrence."""
    from k3.ops.kda import chunk as tc
    from k3.ops.kda import chunk_prefill as tp
    from k3.ops.kda.chunk_common import make_plan

    inputs = [x.cuda() for x in make_raw(1, 8192, 64, 128, 128, seed=3, bias=2.0)]
    assert tp.prefill_segments_for(make_plan(1, 8192, None, inputs[0].device), 64, 128, inputs[0].device) == (4, ())
    with torch.no_grad():
        eager = ours(inputs, None)
        saved = tc.TUNING["prefill_segments"]
        tc.TUNING["prefill_segments"] = 1
        try:
            single = ours(inputs, None)
        finally:
            tc.TUNING["prefill_segments"] = saved
        for a, b in zip(eager, single):
            assert torch.equal(a, b)
        e = errors((eager[0], eager[1], None), _run(ref64, [x.cpu() for x in inputs], grads=False))
        assert e["o"] <= TOL["o"] and e["S"] <= TOL["S"], e
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            other = ours(inputs, None)
        torch.cuda.current_stream().wait_stream(side)
        for a, b in zip(eager, other):
            assert torch.equal(a, b)
        graph = torch.cuda.CUDAGraph()
        ours(inputs, None)  # warm-up outside the capture (compiles, caches the plan)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = ours(inputs, None)
        graph.replay()
        for a, b in zip(eager, captured):
            assert torch.equal(a, b)
        inputs[2].mul_(-1.0)  # v
        eager = ours(inputs, None)
        graph.replay()
        for a, b in zip(eager, captured):
            assert torch.equal(a, b)
