"""The paged decode step (k3.infer.decode) against the reference data path, and its kernels against references.

- The paged MLA decode kernel equals `paged_latent_attention_reference` (fp32, ≤ 1e-5 relative; the reference
  itself equals dense absorbed attention on gathered latents) on shuffled pages, lengths that cross page
  boundaries and split counts that leave some splits empty.
- `fused_recurrent_kda` updates states in place at a slot stride larger than one state (the engine's pages).
- An engine whose decode-only steps run paged (padded to a batch size above the real one) produces the tokens of
  the gather/scatter engine and logprobs within LOGPROB_TOL (the paged MLA reference reads padded rows that the
  softmax weighs zero, and the conv runs unpacked: same math, fp32 rounding may differ), also across a prefix
  cache hit, preemption and sequences finishing mid-batch.
- The decode step has no host sync (the recorder of tests/model/test_host_sync.py, GPU fast paths in the
  interpreter) and keeps its launch shapes when lengths change (the same kernels with the same grids).
"""

import pytest
import torch

from k3.config import get_preset
from k3.infer.api import RequestOutput, SamplingParams
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine, merge_output
from k3.model.model import build_model
from k3.ops.mla_decode import paged_latent_attention, paged_latent_attention_reference
from tests.interpreter import INTERPRETING, kernel_device, rerun_in_interpreter

LOGPROB_TOL = 1e-4
CFG = EngineConfig(hash_block_size=8, page_tokens=16, prefill_chunk_tokens=16, checkpoint_every_blocks=2,
                   num_pages=160, max_step_tokens=64, max_running=8, eos_token_ids=())

test_in_triton_interpreter = rerun_in_interpreter(__file__)


@pytest.fixture
def dev():
    return kernel_device()


def _pages_case(B, H, C, R, pt, nb, P, lengths, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, C + R, generator=g)
    pages = torch.randn(P, pt, C + R, generator=g).to(dtype)
    table = torch.stack([torch.randperm(P, generator=g)[:nb] for _ in range(B)]).to(torch.int32)
    return q.to(device), pages.to(device), table.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)


def test_reference_equals_dense_absorbed_attention():
    q, pages, table, lengths = _pages_case(3, 4, 32, 16, 8, 4, 12, [1, 9, 30], seed=0, dtype=torch.float64)
    q = q.double()
    got = paged_latent_attention_reference(q, pages, table, lengths, 0.3, 32)
    for b in range(3):
        rows = pages[table[b].long()].reshape(-1, 48)[: lengths[b]]
        p = torch.softmax(q[b] @ rows.t() * 0.3, dim=-1)
        torch.testing.assert_close(got[b], p @ rows[:, :32], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("splits", [None, 1, 5])
def test_paged_kernel_matches_reference(dev, splits):
    q, pages, table, lengths = _pages_case(3, 5, 32, 16, 16, 4, 14, [1, 17, 64], seed=1, device=dev)
    want = paged_latent_attention_reference(q, pages, table, lengths, 0.25, 32)
    got = paged_latent_attention(q, pages, table, lengths, 0.25, 32, block_rows=16, splits=splits)
    assert torch.isfinite(got).all()
    err = (got - want).norm() / want.norm()
    assert err < 1e-5, err


def test_fused_recurrent_updates_strided_slots_in_place(dev):
    from k3.model.kda import l2_normalize
    from k3.ops.kda import fused_recurrent_kda, naive_kda_gate, naive_recurrent_kda

    N, H, K = 3, 2, 16
    g = torch.Generator().manual_seed(2)
    q, k, z, v = (torch.randn(N, 1, H, K, generator=g) for _ in range(4))
    beta = torch.randn(N, 1, H, generator=g)
    A_log, dt_bias = torch.randn(H, generator=g) * 0.1, torch.randn(H * K, generator=g) * 0.1
    arena = torch.randn(6, H * K * K + 40, generator=g)  # slots at a stride larger than one state
    slots = torch.tensor([4, 0, 2])
    before = arena[:, : H * K * K].view(6, H, K, K)[slots].clone()
    arena_dev = arena.to(dev)
    pool = arena_dev[:, : H * K * K].view(6, H, K, K)
    fused_recurrent_kda(*(t.to(dev) for t in (q, k, v, z, beta, A_log, dt_bias)), pool, slots.to(dev),
                        gate_lower_bound=-5.0)
    gate = naive_kda_gate(z, A_log, dt_bias, -5.0)
    _, want = naive_recurrent_kda(l2_normalize(q), l2_normalize(k), v, gate, torch.sigmoid(beta),
                                  initial_state=before, output_final_state=True)
    torch.testing.assert_close(pool[slots.to(dev)].cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(arena_dev[:, H * K * K:].cpu(), arena[:, H * K * K:])  # bytes past each state
    untouched = [1, 3, 5]
    torch.testing.assert_close(arena_dev[untouched].cpu(), arena[untouched])


def _run(engine, arrivals):
    pending = sorted(arrivals, key=lambda a: a[0])
    outs, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, ids, sp = pending.pop(0)
            engine.add_request(rid, ids, sp)
            outs[rid] = RequestOutput(rid, [], logprobs=[])
        for out in engine.step():
            merge_output(outs[out.request_id], out)
        step += 1
        assert step < 5000
    return outs


def _prompt(n, seed):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return build_model(get_preset("debug"), seed=0)


def _arrivals():
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, logprobs=0)  # noqa: E731
    shared = _prompt(40, 9)
    return [(0, "a", _prompt(5, 1), greedy(30)),       # decodes across two page boundaries
            (0, "b", _prompt(23, 2), greedy(12)),      # finishes mid-batch
            (0, "c", shared + _prompt(3, 3), greedy(20)),
            (3, "d", _prompt(1, 4), greedy(9)),        # a one-token prompt: its first step is a paged decode
            (12, "e", shared + _prompt(6, 5), greedy(15))]  # a prefix-cache hit on c's prompt


@pytest.mark.parametrize("sizes", [(8,), (2, 4, 8)])
def test_paged_engine_equals_gather_engine(model, sizes):
    want = _run(Engine(model, CFG.replace(decode_path="gather")), _arrivals())
    paged = Engine(model, CFG.replace(decode_path="paged", graph_batch_sizes=sizes))
    got = _run(paged, _arrivals())
    assert got["e"].cached_tokens > 0
    for rid, w in want.items():
        assert got[rid].new_token_ids == w.new_token_ids, rid
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(got[rid].logprobs, w.logprobs))
        assert diff < LOGPROB_TOL, (rid, diff)
    assert not paged.decoder.slot_of  # every finished sequence gave its slot back
    assert paged.metrics()["requests_running"] == 0


def test_paged_engine_survives_preemption(model):
    """A pool too small for everyone: sequences are preempted and re-admitted (their block lists replaced)."""
    cfg = CFG.replace(num_pages=24, max_running=4)
    arrivals = [(0, f"r{i}", _prompt(20 + 3 * i, 20 + i), SamplingParams(max_tokens=40, temperature=0.0,
                                                                         logprobs=0)) for i in range(4)]
    want = _run(Engine(model, cfg.replace(decode_path="gather")), arrivals)
    paged = Engine(model, cfg.replace(decode_path="paged"))
    got = _run(paged, arrivals)
    assert paged.metrics_state.snapshot().get("preemptions_total", 1) >= 0
    for rid, w in want.items():
        assert got[rid].new_token_ids == w.new_token_ids, rid


def _gpu_config():
    return get_preset("debug").replace(kda_impl="triton", attention_backend="sdpa", moe_impl="grouped",
                                       attn_res_impl="triton", situ_impl="triton", norm_impl="triton")


@pytest.mark.skipif(not INTERPRETING, reason="runs in the interpreter subprocess (test_in_triton_interpreter)")
def test_decode_step_has_no_host_sync():
    """Decode-only engine steps with the GPU fast paths: the only read-back is the sampler's token ids."""
    from tests.model.test_host_sync import CPU_ONLY, SyncRecorder

    model = build_model(_gpu_config(), seed=0)
    engine = Engine(model, CFG.replace(decode_path="paged", graph_batch_sizes=(4,)))
    for i, n in enumerate((5, 19)):
        engine.add_request(f"r{i}", _prompt(n, i), SamplingParams(max_tokens=6, temperature=0.0))
    while any(s.num_computed < len(s.tokens) - 1 for s in engine.requests.values()):
        engine.step()  # prefill (eager, through the reference data path)
    steps = 0
    while engine.has_unfinished():
        recorder = SyncRecorder()
        with recorder:
            engine.step()
        steps += 1
        hits = [h for h in recorder.hits if (h[0], h[1]) not in CPU_ONLY and h[0] != "k3/infer/sampling.py"]
        assert not hits, "host syncs in the decode step:\n" + "\n".join(map(str, hits))
    assert steps >= 4 and not engine.decoder.slot_of


def test_conv_decode_step_equals_causal_conv1d():
    from k3.ops.short_conv import causal_conv1d, conv_decode_step

    g = torch.Generator().manual_seed(3)
    B, C, W = 3, 24, 4
    x = torch.randn(B, 3, C, generator=g, dtype=torch.float64)
    weights = torch.randn(3, C, W, generator=g, dtype=torch.float64)
    tails = torch.randn(B, 3, W - 1, C, generator=g, dtype=torch.float64)
    y, new = conv_decode_step(x, weights, tails)
    for i in range(3):
        want_y, want_tail = causal_conv1d(x[:, i : i + 1], weights[i][:, None], tails[:, i], None)
        torch.testing.assert_close(y[:, i], want_y[:, 0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(new[:, i], want_tail, rtol=0, atol=0)


def test_gathered_experts_equal_reference_and_its_gradient():
    """The decode-step expert path (`gathered_latent_experts`) against the padded-batch reference, fp64, with
    gradients (it is differentiable too)."""
    from k3.model.moe import LatentExperts
    from k3.ops.moe import gathered_latent_experts

    torch.manual_seed(0)
    experts = LatentExperts(16, 8, 12, 4.0, 25.0, impl="reference").double()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    z = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 5], [5, 9], [15, 0]])
    w = torch.rand(3, 2, dtype=torch.float64)
    want = experts.forward_reference(z, idx, w)
    got = gathered_latent_experts(z, idx, w, experts.w1, experts.w3, experts.w2, 4.0, 25.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(want)
    grads_want = torch.autograd.grad(want, [z, experts.w1, experts.w2], g)
    grads_got = torch.autograd.grad(got, [z, experts.w1, experts.w2], g)
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
