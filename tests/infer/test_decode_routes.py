"""Routes from the paged decode step (k3.infer.decode): an engine that records routes (RL routing replay,
`k3.posttrain.replay.RouteRecorder`) still decodes through the paged decoder, and records exactly what an engine
on the reference runner records.

- Engine level: the paged engine's decode-only steps all go through `PagedDecoder.run` (none reaches the runner),
  every hand-over carries one row per token of the step (padding rows dropped) and is not overwritten by later
  steps, and every request's recorded routes [prompt + generated − 1, L, k] equal the gather engine's, with the
  same tokens. The arrivals make the batch grow and shrink between steps, pad it to a larger captured size, and
  hit the prefix cache (routes copied from the cached blocks).
- Decoder level: the routes `PagedDecoder.run` hands over equal those of one plain forward over each request's
  whole token sequence.

The CUDA-graph path (static route outputs copied after a replay) is tested on a GPU:
tests/gpu/test_decode_graph_routes.py.
"""

import pytest
import torch

from k3.infer.api import SamplingParams
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.posttrain.replay import RouteRecorder, moe_modules

CFG = EngineConfig(hash_block_size=8, page_tokens=16, prefill_chunk_tokens=16, checkpoint_every_blocks=2,
                   num_pages=160, max_step_tokens=64, max_running=8, eos_token_ids=())


def _prompt(n, seed):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _arrivals():
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0)
    shared = _prompt(40, 9)
    return [(0, "a", _prompt(5, 1), greedy(30)),       # decodes across two page boundaries
            (0, "b", _prompt(23, 2), greedy(12)),      # finishes mid-batch: the batch shrinks
            (0, "c", shared + _prompt(3, 3), greedy(20)),
            (3, "d", _prompt(1, 4), greedy(9)),        # a one-token prompt: its first step is a paged decode
            (12, "e", shared + _prompt(6, 5), greedy(15))]  # joins late (the batch grows), a prefix hit on c's prompt


def _record(engine, arrivals):
    """Run `arrivals` (step, request id, prompt, sampling) on `engine` with a RouteRecorder -> ({request id: tokens},
    {request id: routes [P, L, k]}, {request id: cached prompt tokens}, the batch size of every decoder step).
    Checks every route hand-over's row count, and that a hand-over the sink keeps is never overwritten later."""
    recorder = RouteRecorder(engine)
    sink = recorder.sink
    kept = []  # (a hand-over's top-k as the sink got it, its copy at that time)

    def checked_sink(batch, cu, router_infos):
        assert len(cu) == len(batch.seqs) + 1 and len(router_infos) == recorder.layers
        assert all(info.topk_idx.shape == (cu[-1], recorder.k) for info in router_infos)
        kept.extend((info.topk_idx, info.topk_idx.clone()) for info in router_infos)
        sink(batch, cu, router_infos)

    engine.runner.route_sink = checked_sink
    decoder_steps = []
    if engine.decoder is not None:
        run_decoder, run_runner = engine.decoder.run, engine.runner.run

        def decoder(seqs, route_sink=None):
            assert route_sink is checked_sink, "a route-recording engine must hand the decoder its sink"
            decoder_steps.append(len(seqs))
            return run_decoder(seqs, route_sink)

        def runner(batch):
            decode_only = all(n == 1 and s.num_computed + 1 == len(s.tokens) for s, n in zip(batch.seqs, batch.counts))
            assert not decode_only, "a decode-only step reached the runner"
            return run_runner(batch)

        engine.decoder.run, engine.runner.run = decoder, runner
    pending = sorted(arrivals, key=lambda a: a[0])
    tokens, routes, cached, step = {}, {}, {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, ids, sp = pending.pop(0)
            engine.add_request(rid, ids, sp)
            tokens[rid] = list(ids)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.cached_tokens
            if out.finished:
                routes[out.request_id] = recorder.take(out.request_id)
        step += 1
        assert step < 5000
    assert all(torch.equal(got, copy) for got, copy in kept)
    return tokens, routes, cached, decoder_steps


@pytest.mark.parametrize("sizes", [(8,), (2, 4, 8)])
def test_paged_engine_records_the_runner_engines_routes(model, sizes):
    want_tokens, want_routes, _, none = _record(Engine(model, CFG.replace(decode_path="gather")), _arrivals())
    paged = Engine(model, CFG.replace(decode_path="paged", graph_batch_sizes=sizes))
    tokens, routes, cached, decoder_steps = _record(paged, _arrivals())
    assert decoder_steps, "no decode step went through the paged decoder: Engine.step must hand it the route sink"
    assert not none and len(decoder_steps) > 20
    assert len(set(decoder_steps)) >= 3  # the decode batch grew and shrank
    assert cached["e"] > 0
    for rid, want in want_routes.items():
        assert tokens[rid] == want_tokens[rid], rid
        assert routes[rid].shape == (len(tokens[rid]) - 1, len(moe_modules(model)), model.config.num_experts_per_token)
        assert bool((routes[rid] >= 0).all()), rid  # every position recorded, the cached ones copied
        assert torch.equal(routes[rid], want), rid
    assert not paged.decoder.slot_of


def test_decoder_routes_equal_one_plain_forward(model):
    """The routes the decoder hands over (through the current engine's decoder call, whatever the engine does with a
    route sink) against the router infos of one forward over each request's prompt + generated tokens."""
    engine = Engine(model, CFG.replace(decode_path="paged", graph_batch_sizes=(4, 8)))
    got: dict[str, list[torch.Tensor]] = {}
    run = engine.decoder.run

    def sink(batch, cu, router_infos):
        assert cu == list(range(len(batch.seqs) + 1))
        stacked = torch.stack([info.topk_idx for info in router_infos], dim=1)  # [N, L, k]
        for i, seq in enumerate(batch.seqs):
            got.setdefault(seq.request_id, []).append((seq.num_computed, stacked[i]))

    engine.decoder.run = lambda seqs, route_sink=None: run(seqs, sink)
    tokens = {}
    for rid, ids, n in (("a", _prompt(5, 1), 14), ("b", _prompt(19, 2), 9), ("c", _prompt(1, 3), 11)):
        engine.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0.0))
        tokens[rid] = list(ids)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    for rid, rows in got.items():
        with torch.no_grad():
            infos = model(torch.tensor([tokens[rid][:-1]]), return_router_infos=True).router_infos
        want = torch.stack([info.topk_idx for info in infos], dim=1)  # [P, L, k]
        assert len(rows) >= 8
        for position, row in rows:
            assert torch.equal(row, want[position]), (rid, position)
