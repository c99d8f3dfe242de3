"""Rollouts on the engine (debug preset, fp32): weight sync, routing replay, partial-rollout resume, multi-turn episodes.

The model's stop-token row is scaled up so that sampled replies end at varied lengths (a random model rarely stops),
which is what makes some trajectories finish before others.
"""

import pytest
import torch

from k3.chat.template import ChatTemplate
from k3.config import get_preset
from k3.infer.api import SamplingParams
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.model.model import build_model
from k3.posttrain.envs import ENVIRONMENTS, Environment, Prompt, Task, get_environment, register
from k3.posttrain.replay import RouteRecorder, moe_modules, replayed_routes
from k3.posttrain.rollout import Rollouts, sync_engine

ENGINE = EngineConfig(hash_block_size=8, page_tokens=16, prefill_chunk_tokens=256, max_step_tokens=4096,
                      num_pages=800, max_running=16)
LOGPROB_TOL = 1e-4  # engine vs trainer arithmetic (batched decode vs one packed forward), docs/inference.md


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(tokenizer, seed=0):
    cfg = get_preset("debug").replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                      eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    model = build_model(cfg, seed=seed)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_id] *= 15
    return model


def _engine(tokenizer, seed=0):
    model = _model(tokenizer, seed).eval()
    return Engine(model, ENGINE.replace(eos_token_ids=tuple(tokenizer.stop_ids)))


def _rollouts(engine, tokenizer, k=3, fraction=1.0, recorder=None, max_tokens=24, envs=("math",)):
    return Rollouts(engine, ChatTemplate(tokenizer), {e: get_environment(e) for e in envs}, samples_per_prompt=k,
                    max_tokens=max_tokens, partial_fraction=fraction, recorder=recorder, seed=5)


def _teacher_forced(model, tokens):
    """log p(tokens[t] | tokens[:t]) for t ≥ 1 under `model` (one forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)


def test_engine_logits_equal_trainer_logits_after_sync(tokenizer):
    trainer = _model(tokenizer, seed=0)
    engine = _engine(tokenizer, seed=1)  # other weights
    prompt = ChatTemplate(tokenizer).render([{"role": "user", "content": "What is 12 + 7?"}], reasoning_effort="high")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5)
    before = engine.generate(prompt, greedy)
    with torch.no_grad():  # an update: the trainer's weights move
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 1e-2)
    sync_engine(engine, trainer.state_dict())
    out = engine.generate(prompt, greedy)
    assert out.cached_tokens == 0  # the prefix cached under the old weights is gone
    tokens = prompt + out.new_token_ids
    want = _teacher_forced(trainer, tokens)[len(prompt) - 1:]
    got = torch.tensor([lp.logprob for lp in out.logprobs], dtype=torch.float64)
    assert torch.allclose(got, want, atol=LOGPROB_TOL, rtol=0)
    # the whole distribution at the first position, not only the sampled token
    with torch.no_grad():
        first = torch.log_softmax(trainer(torch.tensor([prompt])).logits[0, -1].double(), -1)
    top_ids, top_lps = zip(*out.logprobs[0].top)
    assert list(top_ids) == torch.topk(first, 5).indices.tolist()
    assert torch.allclose(torch.tensor(top_lps, dtype=torch.float64), torch.topk(first, 5).values, atol=LOGPROB_TOL)
    assert out.new_token_ids != before.new_token_ids or out.logprobs[0].logprob != before.logprobs[0].logprob
    with pytest.raises(ValueError, match="idle engine"):
        engine.add_request("busy", prompt, greedy)
        engine.load_weights(trainer.state_dict())


def test_routing_replay_training_forward_routes_as_the_rollout(tokenizer):
    engine = _engine(tokenizer)
    recorder = RouteRecorder(engine)
    ro = _rollouts(engine, tokenizer, k=3, recorder=recorder)
    for task in get_environment("math").make_tasks(2, seed=0):
        ro.add_group(task, "high")
    groups, stats = ro.run()
    assert stats.cached_tokens > 0  # siblings started from their leader's cached prompt: their routes were copied
    trainer = _model(tokenizer)
    with torch.no_grad():  # the trainer has moved on: its own routing now differs from the rollout's
        for moe in moe_modules(trainer):
            moe.gate.weight.add_(torch.randn(moe.gate.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    differs = 0
    for traj in (t for g in groups for t in g.trajectories):
        inputs = traj.tokens[:-1]
        assert traj.routes.shape[0] == len(inputs)  # every input position was computed and recorded
        routes = traj.routes.long()
        assert bool((routes >= 0).all())
        with torch.no_grad(), replayed_routes(trainer, routes):
            out = trainer(torch.tensor([inputs]), return_router_infos=True)
        for j, info in enumerate(out.router_infos):
            assert torch.equal(info.topk_idx, routes[:, j])
        with torch.no_grad():
            free = trainer(torch.tensor([inputs]), return_router_infos=True)
        differs += sum(int((info.topk_idx != routes[:, j]).any()) for j, info in enumerate(free.router_infos))
    assert differs > 0  # without replay the trainer would have routed some tokens elsewhere
    assert all(m.replay_topk is None for m in moe_modules(trainer))  # the replay ends with its block


def test_partial_rollout_resume_equals_uninterrupted(tokenizer):
    """λ < 1 pauses trajectories mid-reply; resumed under the same weights (the engine re-synced, its cache dropped)
    they sample exactly what an uninterrupted rollout samples."""
    tasks = get_environment("math").make_tasks(4, seed=1)
    whole = _rollouts(_engine(tokenizer), tokenizer, k=3, fraction=1.0)
    for t in tasks:
        whole.add_group(t, "high")
    reference, _ = whole.run()
    engine = _engine(tokenizer)
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    parts = _rollouts(engine, tokenizer, k=3, fraction=0.3)
    for t in tasks:
        parts.add_group(t, "high")
    done, paused = [], 0
    while parts.groups:
        complete, stats = parts.run()
        done += complete
        paused += stats.paused
        sync_engine(engine, weights)  # what an RL iteration does between two rollouts
    assert paused > 0
    resumed = [t for g in done for t in g.trajectories if t.pauses]
    assert resumed
    ref = {(t.group, t.sample): t for g in reference for t in g.trajectories}
    for traj in (t for g in done for t in g.trajectories):
        want = ref[(traj.group, traj.sample)]
        assert traj.tokens == want.tokens and traj.generated == want.generated
        assert (traj.truncated, traj.task_reward, traj.budget_tokens) == (want.truncated, want.task_reward,
                                                                           want.budget_tokens)
        assert torch.allclose(torch.tensor(traj.logprobs), torch.tensor(want.logprobs), atol=LOGPROB_TOL, rtol=0)


@pytest.fixture
def relay_env():
    @register("relay-test")
    class Relay(Environment):
        """Answers every reply with a user message, for three replies."""

        agentic = True
        max_turns = 3

        def reset(self, task):
            self.task, self.replies = task, []
            return Prompt([{"role": "user", "content": "Say something."}])

        def step(self, reply):
            self.record(reply)
            return [{"role": "user", "content": f"And then? ({len(self.replies)})"}]

        def verify(self):
            return float(len(self.replies) == 3)

    yield Relay
    del ENVIRONMENTS["relay-test"]


def test_multi_turn_episode_tokens_masks_and_logprobs(tokenizer, relay_env):
    engine = _engine(tokenizer)
    template = ChatTemplate(tokenizer)
    ro = _rollouts(engine, tokenizer, k=2, max_tokens=40, envs=("relay-test",))
    ro.add_group(Task("r", "relay-test", {}), "low")
    [group], _ = ro.run()
    for traj in group.trajectories:
        assert traj.done and traj.turns <= 3
        # the prompt is the template's; after each reply but the last: the observation, then the generation prompt
        prompt = template.render([{"role": "user", "content": "Say something."}], reasoning_effort="low")
        assert traj.tokens[:len(prompt)] == prompt and not any(traj.generated[:len(prompt)])
        spans, i = [], len(prompt)
        while i < len(traj.tokens):
            j = i
            while j < len(traj.tokens) and traj.generated[j]:
                j += 1
            spans.append((i, j))
            k = j
            while k < len(traj.tokens) and not traj.generated[k]:
                k += 1
            if k > j:
                turn = len(spans)
                observed = template.render_message({"role": "user", "content": f"And then? ({turn})"}, thinking=True)
                assert traj.tokens[j:k] == observed + template.generation_prompt(thinking=True)
            i = k
        assert len(spans) == traj.turns
        assert traj.budget_tokens == traj.num_generated == sum(traj.generated)  # agentic: every generated token
        assert traj.task_reward == float(traj.turns == 3)
        # each generated token's behaviour log-prob is the model's own at that position
        want = _teacher_forced(engine.model, traj.tokens)
        mask = torch.tensor(traj.generated[1:])
        got = torch.tensor(traj.logprobs[1:], dtype=torch.float64)
        assert torch.allclose(got[mask], want[mask], atol=LOGPROB_TOL, rtol=0)
        assert torch.count_nonzero(got[~mask]) == 0
