"""One RL training step through `k3.posttrain.rl.rl_step`, the path `k3 rl` takes (documents, packed rows, the training
forward, the policy loss, Per-Head Muon + AdamW at the default learning rate), on the debug preset in fp32:

- the trainer scores exactly the generated tokens, each at the position before it, with the log-probability the
  sampling policy gave it (the step's KL to the behaviour policy is zero on-policy);
- the update moves the policy the way the rewards say: the rewarded reply's log-probability goes up, the other's
  goes down, for every loss kind.
"""

import pytest
import torch

from k3.chat.template import ChatTemplate
from k3.config import get_preset
from k3.model.model import build_model
from k3.posttrain.envs import Task, get_environment
from k3.posttrain.rl import RLConfig, build_documents, rl_step
from k3.posttrain.rl_loss import LossConfig
from k3.posttrain.rollout import Group, Trajectory
from k3.train.runtime import SingleProcess

QUESTION = [{"role": "user", "content": "What is 12 + 7?"}]
# rewarded, then not; they differ from their first token (a token two replies share after the same prefix is
# pushed by the sum of their advantages, which is a correct update but not what this test reads)
REPLIES = [("12 + 7 = 19.", "The answer is 19."), ("I guess five.", "It is 5.")]


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(tokenizer):
    cfg = get_preset("debug").replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                      eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    return build_model(cfg, seed=0)


def _reply_logprobs(model, tokens: list[int], start: int) -> torch.Tensor:
    """log π(tokens[t] | tokens[:t]) for t ≥ start, by one plain forward (the sampling policy's values)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, -1)[start - 1:-1].gather(1, torch.tensor(tokens[start:])[:, None]).squeeze(1)


def _group(model, template) -> Group:
    """One group of the math environment: the replies as the policy would have sampled them, with its log-probs."""
    prompt = template.render(QUESTION, reasoning_effort="high")
    task = Task("t", "math", {"question": QUESTION[0]["content"], "answer": "19"}, b0=100.0)
    group = Group(0, task, "high")
    for s, (thinking, answer) in enumerate(REPLIES):
        tokens = template.render(QUESTION + [{"role": "assistant", "reasoning_content": thinking, "content": answer}],
                                 reasoning_effort="high", add_generation_prompt=False)
        assert tokens[:len(prompt)] == prompt  # the reply follows the rollout's prompt exactly
        n = len(prompt)
        logprobs = [0.0] * n + _reply_logprobs(model, tokens, n).tolist()
        generated = [False] * n + [True] * (len(tokens) - n)
        traj = Trajectory(0, s, task, "high", get_environment("math")(), tokens, generated, logprobs, prompt_len=n,
                          turn_start=n)
        traj.done, traj.task_reward = True, float(s == 0)
        traj.num_generated = len(tokens) - n
        group.trajectories.append(traj)
    return group


@pytest.mark.parametrize("kind", ["k3", "grpo", "dapo"])
def test_one_update_raises_the_rewarded_reply_and_lowers_the_other(tokenizer, kind):
    model = _model(tokenizer)
    template = ChatTemplate(tokenizer)
    group = _group(model, template)
    cfg = RLConfig(init_from="unused", loss=LossConfig(kind), muon_ns_dtype="float32")
    parallel = SingleProcess(torch.device("cpu")).parallelize(model)
    optimizer = parallel.build_optimizer(model.config, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                         ns_dtype=torch.float32)
    rewards = [[t.task_reward for t in group.trajectories]]
    docs = build_documents([group], rewards, kind, None)
    assert [sum(d.loss) for d in docs] == [t.num_generated for t in group.trajectories]
    before = [_reply_logprobs(model, t.tokens, t.prompt_len).sum().item() for t in group.trajectories]
    metrics = rl_step(model, optimizer, docs, cfg, torch.device("cpu"), parallel, tokenizer.pad_id, None)
    # on-policy: the trainer's log-prob of every loss token is the one it was sampled with
    assert metrics["loss_tokens"] == sum(t.num_generated for t in group.trajectories)
    assert metrics["log_ratio_rms"] < 1e-5 and metrics["kl"] < 1e-10
    after = [_reply_logprobs(model, t.tokens, t.prompt_len).sum().item() for t in group.trajectories]
    moved = [a - b for a, b in zip(after, before)]
    assert moved[0] > 0 > moved[1], moved
