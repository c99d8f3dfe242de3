"""Tensor- and expert-parallel serving on gloo (k3.parallel.inference): the engine run SPMD over 2 and 4 ranks gives
the single-process engine's greedy tokens exactly, with prefix caching, preemption and the CPU pool on; logits and
logprobs within LOGIT_TOL (fp32: the row-parallel all-reduces and the expert split only reorder sums, measured
≲ 1e-6). Also the sharded checkpoint loader, and prefill/decode disaggregation across TP degrees (1→2, 2→1)."""

import asyncio
import dataclasses

import pytest
import torch
import torch.distributed as dist

from k3.config import get_preset
from k3.infer.api import RequestOutput, SamplingParams
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine, merge_output
from k3.infer.transfer import DisaggregatedEngine, PrefillServer, PrefillWorker
from k3.model.model import build_model
from k3.parallel.inference import TPGroup, load_sharded, serving_engine, shard_model
from tests.infer.conftest import every_path_matters
from tests.parallel.spawn import run_workers

LOGIT_TOL = 1e-4
CFG = EngineConfig(hash_block_size=8, page_tokens=16, prefill_chunk_tokens=16, checkpoint_every_blocks=2,
                   num_pages=160, max_step_tokens=64, max_running=8, eos_token_ids=())
CPU_POOL = 200 * 40_000


pytestmark = pytest.mark.usefixtures("one_thread")


def model(heads: int = 2):
    """The debug preset (fp32) with random AttnRes queries and router biases; `heads` KDA/MLA heads."""
    config = get_preset("debug")
    if heads != config.num_attention_heads:
        lin = dataclasses.replace(config.linear_attn_config, num_heads=heads)
        config = config.replace(num_attention_heads=heads, num_key_value_heads=heads, linear_attn_config=lin)
    return every_path_matters(build_model(config, seed=0))


def prompt(n, seed, V=512):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, logprobs=0)


def workload():
    """(step, id, prompt, sampling): overlapping requests, a repeated prompt and a follow-up turn (prefix hits), one
    seeded sampled request."""
    base = [(0, f"r{i}", prompt(20 + 5 * i, 30 + i), greedy(16)) for i in range(4)]
    again = (6, "again", base[0][2], greedy(8))
    follow = (9, "turn2", base[1][2] + prompt(7, 99), greedy(8))
    sampled = (2, "sampled", prompt(13, 7), SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=5,
                                                           logprobs=0))
    return base + [again, follow, sampled]


def reload_workload():
    """A prompt, traffic that pushes its pages out to the CPU pool, then the prompt again (reloaded from there)."""
    P = prompt(37, 9)
    return ([(0, "P", P, greedy(8))] + [(15 * (i + 1), f"o{i}", prompt(60, 20 + i), greedy(4)) for i in range(3)]
            + [(60, "P2", P, greedy(8))])


# (engine config, workload, the counter it must exercise): device prefix hits; preemption (24 pages cannot hold the
# four requests); CPU-pool reloads. The CPU pool is on in all three.
PHASES = [(CFG.replace(cpu_pool_bytes=CPU_POOL), workload, "prefix_hit_requests_total"),
          (CFG.replace(num_pages=26, cpu_pool_bytes=CPU_POOL), workload, "preemptions_total"),
          (CFG.replace(num_pages=30, cpu_pool_bytes=CPU_POOL), reload_workload, "cpu_pool_hits_total")]


def run(engine, arrivals):
    pending = sorted(arrivals, key=lambda a: a[0])
    outs, step = {}, 0
    while pending or engine.has_unfinished():
        if not engine.has_unfinished():
            step = max(step, pending[0][0])  # idle until the next arrival: no empty steps
        while pending and pending[0][0] <= step:
            _, rid, ids, sp = pending.pop(0)
            engine.add_request(rid, ids, sp)
            outs[rid] = RequestOutput(rid, [], logprobs=[])
        for out in engine.step():
            merge_output(outs[out.request_id], out)
        step += 1
        assert step < 2000
    return outs


def summary(outs):
    return {rid: (o.new_token_ids, [lp.logprob for lp in o.logprobs], o.finish_reason) for rid, o in outs.items()}


def _serve_worker(rank, world, heads, expert_parallel):
    tp = TPGroup.world()
    local = shard_model(model(heads), tp, expert_parallel)
    results = []
    for cfg, make, counter in PHASES:
        engine = Engine(local, cfg)
        front = serving_engine(engine, tp)
        if rank != 0:
            front.follow()
            continue
        outs = run(front, make())
        front.shutdown()
        results.append({"outs": summary(outs), "counter": engine.metrics()[counter], "kda_heads": engine.spec.num_heads})
    return results


def check_parity(world, heads, expert_parallel):
    got = run_workers(_serve_worker, world, heads, expert_parallel)[0]
    full = model(heads)
    for (cfg, make, counter), phase in zip(PHASES, got):
        assert phase["kda_heads"] == heads // world  # the paged KDA cache holds this rank's heads only
        assert phase["counter"] > 0, counter
        ref = summary(run(Engine(full, cfg), make()))
        for rid, (tokens, lps, reason) in ref.items():
            g_tokens, g_lps, g_reason = phase["outs"][rid]
            assert g_tokens == tokens and g_reason == reason, rid
            assert max(abs(a - b) for a, b in zip(lps, g_lps)) < LOGIT_TOL, rid


@pytest.mark.parametrize("expert_parallel", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_two_ranks_equal_one_process(expert_parallel):
    check_parity(2, 2, expert_parallel)


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_four_ranks_equal_one_process(expert_parallel):
    check_parity(4, 4, expert_parallel)


def _logits_worker(rank, world, heads, expert_parallel):
    tp = TPGroup.world()
    local = shard_model(model(heads), tp, expert_parallel)
    ids = torch.tensor([prompt(23, 3) + prompt(9, 4)])
    cu = torch.tensor([0, 23, 32])
    with torch.no_grad():
        return local(ids, cu_seqlens=cu).logits


@pytest.mark.parametrize("world,heads,expert_parallel", [(2, 2, False), (2, 2, True), (4, 4, True)])
def test_sharded_logits_equal_full_model(world, heads, expert_parallel):
    full = model(heads)
    ids = torch.tensor([prompt(23, 3) + prompt(9, 4)])
    with torch.no_grad():
        ref = full(ids, cu_seqlens=torch.tensor([0, 23, 32])).logits
    for logits in run_workers(_logits_worker, world, heads, expert_parallel):
        assert logits.shape == ref.shape
        assert (logits - ref).abs().max() < 1e-5


def _load_worker(rank, world, path, expert_parallel):
    tp = TPGroup.world()
    local = load_sharded(path, tp, expert_parallel, dtype=torch.float32)
    ref = shard_model(model(2), tp, expert_parallel)
    mine = {k: v.shape for k, v in local.state_dict().items()}
    same = all(torch.equal(v, ref.state_dict()[k]) for k, v in local.state_dict().items())
    return same, mine


@pytest.mark.parametrize("layout", ["k3", "release"])
def test_load_sharded_reads_only_this_ranks_slice(tmp_path, layout):
    from k3.checkpoint import save_checkpoint
    from k3.convert.release import save_release

    full = model(2)
    if layout == "k3":
        full.config.save(tmp_path)  # save_checkpoint writes the files it is given; config.json is one
        path = save_checkpoint(tmp_path / "ckpt", 1, full.state_dict(), {}, extra_files={
            "config.json": (tmp_path / "config.json").read_text()})
    else:
        path = tmp_path / "release"
        save_release(full, path, dtype=torch.float32, shard_size="1MB")  # several shards
    for ep in (False, True):
        results = run_workers(_load_worker, 2, str(path), ep)
        assert all(same for same, _ in results)
        shapes = results[0][1]
        assert shapes["model.layers.1.self_attn.q_proj.weight"][0] == 64  # one of the 2 heads
        assert shapes["lm_head.weight"][0] == 256  # vocab-parallel head
        experts = shapes["model.layers.1.block_sparse_moe.experts.w1"]
        assert tuple(experts) == ((8, 64, 64) if ep else (16, 32, 64))


# -- prefill/decode disaggregation --------------------------------------------------------------------------------

def long_requests():
    return [(f"p{i}", prompt(40 + 9 * i, 200 + i), greedy(12)) for i in range(3)] + \
        [("s", prompt(30, 250), SamplingParams(max_tokens=9, temperature=0.8, seed=3, logprobs=0))]


async def _stream_all(aeng, reqs):
    async def one(rid, ids, sp):
        total = RequestOutput(rid, [], logprobs=[])
        async for out in aeng.stream(rid, ids, sp):
            merge_output(total, out)
        return total
    return {o.request_id: o for o in await asyncio.gather(*(one(*r) for r in reqs))}


def single_engine_outputs():
    engine = Engine(model(), CFG)
    return summary(run(engine, [(0, rid, ids, sp) for rid, ids, sp in long_requests()]))


def check_against_single(got, ref):
    for rid, (tokens, lps, reason) in ref.items():
        g_tokens, g_lps, g_reason = got[rid]
        assert g_tokens == tokens and g_reason == reason, rid
        assert max(abs(a - b) for a, b in zip(lps, g_lps)) < LOGIT_TOL, rid


def test_disaggregated_one_to_one_and_fallback():
    ref = single_engine_outputs()
    prefill = Engine(model(), CFG)
    worker = PrefillWorker(prefill)
    server = PrefillServer(worker)
    decode = Engine(model(), CFG)
    aeng = DisaggregatedEngine(decode, server.address)
    try:
        got = summary(asyncio.run(_stream_all(aeng, long_requests())))
        assert aeng.transfers == len(ref) and aeng.transfer_fallbacks == 0
        assert aeng.metrics()["transfers_total"] == len(ref) and aeng.metrics()["transfer_fallbacks_total"] == 0
        # the decode instance never ran a prompt: one forward token per generated token after the first
        assert decode.metrics()["forward_tokens_total"] == sum(len(t) - 1 for t, _, _ in ref.values())
        check_against_single(got, ref)
    finally:
        aeng.shutdown()
        server.shutdown()
        worker.shutdown()


def test_failed_transfer_falls_back_to_local_prefill():
    import socket
    import socketserver
    import threading

    from k3.infer.transfer import send_frame

    ref = single_engine_outputs()

    class Cut(socketserver.BaseRequestHandler):  # answers "prefilled", then half a blob, then hangs up
        def handle(self):
            send_frame(self.request, b'{"status": "prefilled"}')
            self.request.sendall((10_000).to_bytes(8, "big") + b"\0" * 5000)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Cut)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()
    try:
        for peer in (server.server_address, dead):
            decode = Engine(model(), CFG)
            aeng = DisaggregatedEngine(decode, peer, timeout=5)
            try:
                got = summary(asyncio.run(_stream_all(aeng, long_requests())))
            finally:
                aeng.shutdown()
            assert aeng.transfer_fallbacks == len(ref) and aeng.transfers == 0
            check_against_single(got, ref)
    finally:
        server.shutdown()
        server.server_close()


def _disagg_worker(rank, world, prefill_ranks, decode_ranks):
    pre, dec = TPGroup.of(prefill_ranks), TPGroup.of(decode_ranks)
    mine = pre if rank in prefill_ranks else dec
    engine = Engine(shard_model(model(), mine), CFG)
    front = serving_engine(engine, mine)
    port = [None]
    worker = server = None
    if rank == prefill_ranks[0]:
        worker = PrefillWorker(front)
        server = PrefillServer(worker)
        port[0] = server.address[1]
    dist.broadcast_object_list(port, src=prefill_ranks[0])
    done = torch.zeros(1)
    if mine.rank != 0:
        front.follow()
        return None
    if rank == prefill_ranks[0]:
        dist.recv(done, src=decode_ranks[0])  # the decode side is finished
        server.shutdown()
        worker.shutdown()
        front.shutdown()
        return None
    aeng = DisaggregatedEngine(front, ("127.0.0.1", port[0]))
    try:
        got = summary(asyncio.run(_stream_all(aeng, long_requests())))
    finally:
        aeng.shutdown()
    front.shutdown()
    dist.send(done, dst=prefill_ranks[0])
    return {"outs": got, "transfers": aeng.transfers, "forward": engine.metrics()["forward_tokens_total"]}


@pytest.mark.parametrize("prefill_ranks,decode_ranks", [([0], [1, 2]), ([0, 1], [2])], ids=["tp1to2", "tp2to1"])
def test_disaggregated_across_tp_degrees(prefill_ranks, decode_ranks):
    ref = single_engine_outputs()
    results = run_workers(_disagg_worker, 3, prefill_ranks, decode_ranks)
    got = results[decode_ranks[0]]
    assert got["transfers"] == len(ref)
    assert got["forward"] == sum(len(t) - 1 for t, _, _ in ref.values())
    check_against_single(got["outs"], ref)


def _prefill_locally(engine, rid, ids, sp):
    """The prefill instance's part, synchronously: run to the first token, export, drop."""
    from k3.infer.transfer import from_bytes, merge_heads, split_heads, to_bytes

    engine.add_request(rid, ids, sp)
    while True:
        outs = engine.step()
        if outs:
            break
    state = dataclasses.replace(engine.export_sequence(rid), first_output=outs[0])
    engine.abort(rid)
    wire = from_bytes(to_bytes(state))
    for a, b in zip(wire.kda_conv + wire.kda_state + wire.mla, state.kda_conv + state.kda_state + state.mla):
        assert torch.equal(a, b)  # the blob is lossless
    halves = merge_heads([split_heads(wire, 2, 0), split_heads(wire, 2, 1)])
    assert all(torch.equal(a, b) for a, b in zip(halves.kda_conv + halves.kda_state, wire.kda_conv + wire.kda_state))
    return wire


def test_import_into_a_full_engine_waits_and_recomputes():
    """No slot free on the decode side: the imported request waits and is recomputed, with the same output."""
    ref = single_engine_outputs()
    prefill = Engine(model(), CFG)
    decode = Engine(model(), CFG.replace(max_running=1))
    outs = {}
    for rid, ids, sp in long_requests():
        state = _prefill_locally(prefill, rid, ids, sp)
        outs[rid] = RequestOutput(rid, [], logprobs=[])
        merge_output(outs[rid], decode.add_prefilled(state))
    assert len(decode.scheduler.running) == 1 and len(decode.scheduler.waiting) == 3
    while decode.has_unfinished():
        for out in decode.step():
            merge_output(outs[out.request_id], out)
    check_against_single(summary(outs), ref)
    # the three that waited ran their prompt and first token again here
    assert decode.metrics()["forward_tokens_total"] > sum(len(ids) for _, ids, _ in long_requests()[1:])
