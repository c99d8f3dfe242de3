"""RL on one GPU: the engine in bf16 with its paged decode path, routes recorded and replayed under autocast with the
fast router and grouped experts, and `k3 rl` end to end on CUDA."""

import json

import pytest
import torch

from k3.chat.template import ChatTemplate
from k3.checkpoint import save_checkpoint
from k3.config import get_preset
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.model.model import build_model
from k3.posttrain.budget import TauCurriculum
from k3.posttrain.envs import get_environment
from k3.posttrain.replay import RouteRecorder, replayed_routes
from k3.posttrain.rl import RLConfig, rl
from k3.posttrain.rollout import Rollouts
from k3.train.loop import autocast_context
from k3.train.metrics import MetricsLog

pytestmark = pytest.mark.gpu


def _model(tokenizer):
    cfg = get_preset("debug").replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                      eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_id] *= 15  # replies of varied lengths
    return model


def test_routes_recorded_on_the_paged_path_and_replayed(tokenizer):
    trainer = _model(tokenizer).cuda()
    engine_model = _model(tokenizer).cast(torch.bfloat16).cuda().eval()
    engine = Engine(engine_model, EngineConfig(hash_block_size=8, max_running=16, max_step_tokens=4096,
                                               eos_token_ids=tuple(tokenizer.stop_ids)))
    assert engine.decoder is not None  # CUDA decodes in place on the pool, recording routes too
    recorder = RouteRecorder(engine)
    ro = Rollouts(engine, ChatTemplate(tokenizer), {"math": get_environment("math")}, samples_per_prompt=3,
                  max_tokens=24, recorder=recorder)
    for task in get_environment("math").make_tasks(2, seed=0):
        ro.add_group(task, "high")
    groups, stats = ro.run()
    assert stats.cached_tokens > 0
    device = torch.device("cuda")
    for traj in (t for g in groups for t in g.trajectories):
        inputs = traj.tokens[:-1]
        routes = traj.routes.long()
        assert routes.shape[0] == len(inputs) and bool((routes >= 0).all())
        with torch.no_grad(), replayed_routes(trainer, routes.to(device)), autocast_context(device):
            out = trainer(torch.tensor([inputs], device=device), return_router_infos=True)
        for j, info in enumerate(out.router_infos):
            assert torch.equal(info.topk_idx.cpu(), routes[:, j])


def test_rl_on_cuda(tmp_path, tokenizer):
    tokenizer.save(tmp_path / "tokenizer")
    model = _model(tokenizer)
    save_checkpoint(tmp_path / "policy" / "checkpoints", 1, model.state_dict(), {},
                    {"config.json": json.dumps(model.config.to_config_json())}, {"tokenizer": tmp_path / "tokenizer"})
    cfg = RLConfig(init_from=str(tmp_path / "policy"), out=str(tmp_path / "rl"), num_tasks=12, heldout_tasks=2,
                   iterations=3, prompts_per_iteration=4, samples_per_prompt=4, partial_fraction=0.5, max_tokens=24,
                   b0_samples=2, eval_every=3, checkpoint_every=3, lr=3e-4, device="cuda",
                   curriculum=TauCurriculum(max_first_iterations=1, anneal_iterations=2))
    summary = rl(cfg, progress=False, log=lambda *a: None)
    assert summary.iterations == 3
    records = [r for r in MetricsLog(tmp_path / "rl" / "metrics.jsonl").read() if r["kind"] == "rl"]
    trained = [r for r in records if not r.get("skipped")]
    assert trained
    # the bf16 engine and the autocast trainer agree on the behaviour policy up to bf16 rounding
    assert trained[0]["kl"] < 1e-2
