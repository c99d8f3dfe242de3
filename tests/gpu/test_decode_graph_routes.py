"""Routes from the paged decoder's CUDA graphs (one GPU): an engine that records routes (RL routing replay) decodes
through graphs that hold every MoE layer's routes as static outputs, and records what the eager runner records.

- fp32, debug preset with every GPU fast path, TF32 off: the route-recording paged engine with graphs (every decode
  step a replay) gives the gather engine's tokens and, token for token, its recorded routes over prompt and
  generated positions, while the batch grows and shrinks and a prompt hits the prefix cache (the arrivals of
  tests/infer/test_decode_routes.py, whose recording also checks that route hand-overs the sink keeps on the GPU
  are not overwritten by later replays: the step copies the real rows out of the static outputs).
- bf16, tiny preset: capturing the routes changes nothing in the step: the route-recording engine's tokens and
  logprobs equal the plain graph engine's exactly.
"""

import pytest
import torch

from k3.infer.api import RequestOutput, SamplingParams
from k3.infer.engine import Engine, merge_output
from k3.model.model import build_model
from k3.posttrain.replay import RouteRecorder
from tests.gpu.conftest import gpu_config
from tests.infer.conftest import every_path_matters
from tests.infer.test_decode_routes import CFG, _arrivals, _prompt, _record

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]


def test_graph_routes_equal_runner_routes_fp32():
    model = every_path_matters(build_model(gpu_config(), seed=0, device="cuda"))
    want_tokens, want_routes, _, _ = _record(Engine(model, CFG.replace(decode_path="gather")), _arrivals())
    engine = Engine(model, CFG.replace(decode_path="paged", cuda_graphs=True, graph_batch_sizes=(2, 4, 8)))
    tokens, routes, cached, decoder_steps = _record(engine, _arrivals())
    assert engine.decoder.route_graphs and not engine.decoder.graphs, "the decode steps did not replay route graphs"
    assert len(decoder_steps) > 20 and cached["e"] > 0
    for rid, want in want_routes.items():
        assert tokens[rid] == want_tokens[rid], rid
        assert torch.equal(routes[rid], want), rid


def test_route_graphs_change_nothing_bf16():
    model = build_model(gpu_config("tiny"), seed=0, device="cuda", dtype=torch.bfloat16)
    cfg = CFG.replace(decode_path="paged", cuda_graphs=True, num_pages=400)
    outs = []
    for record in (False, True):
        engine = Engine(model, cfg)
        recorder = RouteRecorder(engine) if record else None
        got = {}
        for i, n in enumerate((33, 200, 5)):
            engine.add_request(f"r{i}", _prompt(n, i), SamplingParams(max_tokens=24, temperature=0.0, logprobs=0))
            got[f"r{i}"] = RequestOutput(f"r{i}", [], logprobs=[])
        while engine.has_unfinished():
            for out in engine.step():
                merge_output(got[out.request_id], out)
        assert bool(engine.decoder.route_graphs) == record and bool(engine.decoder.graphs) != record
        if record:
            assert recorder.take("r1").shape[0] == 200 + 24 - 1
        outs.append(got)
    plain, recorded = outs
    for rid, p in plain.items():
        assert recorded[rid].new_token_ids == p.new_token_ids, rid
        assert [lp.logprob for lp in recorded[rid].logprobs] == [lp.logprob for lp in p.logprobs], rid
