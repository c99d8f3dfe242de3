"""The RL loss against hand computation: advantages, the k3 loss and its gradient on a 3-token example, the GRPO/DAPO
clipping, per-token advantages, and the loss weights."""

import math

import pytest
import torch

from k3.posttrain.rl_loss import LossConfig, group_advantages, policy_loss, token_logprobs, token_weights


def test_group_advantages_subtract_the_group_mean():
    r = torch.tensor([[1.0, 0.0, 0.0, -1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]])
    a = group_advantages(r)
    assert a.tolist() == [[1.0, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0], [-0.5, 0.5, -0.5, 0.5]]
    assert torch.allclose(a.sum(1), torch.zeros(3))
    with pytest.raises(ValueError):
        group_advantages(torch.ones(4))


# three tokens over a vocabulary of 3: logits, targets, the behaviour policy's log-probs, per-token advantages
LOGITS = [[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [-1.0, 1.0, 3.0]]
TARGETS = [0, 2, 1]
OLD = [-0.3, -1.2, -2.0]
ADV = [1.0, -0.5, 2.0]  # distinct per token: token-level advantages as on-policy distillation passes them
TAU = 0.4


def _by_hand():
    """The k3 loss and d loss / d logits from the formulas, in plain Python: per token with w = 1/3,
    ℓ = −A·lp + τ/2·(lp − old)², dℓ/dz = w·(−A + τ·(lp − old))·(onehot(y) − softmax(z))."""
    loss, grads = 0.0, []
    for z, y, old, a in zip(LOGITS, TARGETS, OLD, ADV):
        lse = math.log(sum(math.exp(v) for v in z))
        p = [math.exp(v - lse) for v in z]
        lp = z[y] - lse
        loss += (-a * lp + TAU / 2 * (lp - old) ** 2) / 3
        coef = (-a + TAU * (lp - old)) / 3
        grads.append([coef * ((1.0 if j == y else 0.0) - p[j]) for j in range(3)])
    return loss, grads


def test_k3_loss_and_gradient_match_hand_computation():
    z = torch.tensor(LOGITS, dtype=torch.float64, requires_grad=True)
    lp = token_logprobs(z, torch.tensor(TARGETS))
    weights = torch.tensor(token_weights("k3", [3]), dtype=torch.float64).repeat(3)
    loss, stats = policy_loss(lp, torch.tensor(OLD, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64),
                              weights, LossConfig("k3", reg_tau=TAU))
    loss.backward()
    want_loss, want_grad = _by_hand()
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert torch.allclose(z.grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    # the KL estimate: Σ ρ − 1 − log ρ
    lr = [lpv - o for lpv, o in zip(lp.tolist(), OLD)]
    assert stats["kl"].item() == pytest.approx(sum(math.exp(v) - 1 - v for v in lr), rel=1e-12)


def test_regulariser_pulls_toward_the_behaviour_policy():
    """With zero advantage the gradient pushes log π_θ toward log π_old and vanishes on-policy."""
    z = torch.tensor([LOGITS[0]], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0])
    lp = token_logprobs(z, y)
    old = lp.detach() - 0.5  # the trainer now gives the token more mass than the behaviour policy did
    loss, _ = policy_loss(lp, old, torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64),
                          LossConfig("k3", reg_tau=1.0))
    loss.backward()
    assert z.grad[0, 0] > 0  # descent lowers the target's logit
    z.grad = None
    loss, _ = policy_loss(token_logprobs(z, y), lp.detach(), torch.zeros(1, dtype=torch.float64),
                          torch.ones(1, dtype=torch.float64), LossConfig("k3", reg_tau=1.0))
    loss.backward()
    assert torch.count_nonzero(z.grad) == 0


@pytest.mark.parametrize("kind, high", [("grpo", 0.2), ("dapo", 0.28)])
def test_clipped_losses(kind, high):
    """ℓ = −min(ρA, clip(ρ)A): inside the range the gradient is −A·ρ·(onehot − p)·w; a token whose ratio left the range
    in the direction its advantage pushes gets no gradient."""
    z = torch.tensor(LOGITS, dtype=torch.float64, requires_grad=True)
    y = torch.tensor(TARGETS)
    lp = token_logprobs(z, y)
    base = lp.detach()
    # token 0: ρ = e^0.1 (inside); token 1: ρ = e^−0.5, A < 0 (clipped below); token 2: ρ = 1.5 > 1 + high, A > 0
    old = base - torch.tensor([0.1, -0.5, math.log(1.5)], dtype=torch.float64)
    adv = torch.tensor(ADV, dtype=torch.float64)
    w = torch.full((3,), 1 / 3, dtype=torch.float64)
    cfg = LossConfig(kind, clip_eps=0.2, clip_eps_high=0.28)
    loss, stats = policy_loss(lp, old, adv, w, cfg)
    loss.backward()
    rho = torch.exp(base - old)
    p = torch.softmax(z.detach(), -1)
    onehot = torch.nn.functional.one_hot(y, 3).double()
    want0 = -adv[0] * rho[0] * (onehot[0] - p[0]) / 3
    assert torch.allclose(z.grad[0], want0, rtol=1e-12)
    assert torch.count_nonzero(z.grad[1:]) == 0
    assert stats["clipped"].item() == 2
    clipped_vals = [rho[0] * adv[0], (1 - 0.2) * adv[1], (1 + high) * adv[2]]
    assert loss.item() == pytest.approx(-sum(float(v) for v in clipped_vals) / 3, rel=1e-12)


def test_token_weights():
    assert token_weights("k3", [2, 0, 3]) == [0.2, 0.2, 0.2]
    assert token_weights("dapo", [2, 3]) == [0.2, 0.2]
    # grpo: the mean over each trajectory's tokens, then over the trajectories that have any
    assert token_weights("grpo", [2, 0, 4]) == [0.25, 0.0, 0.125]


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="loss must be"):
        LossConfig("ppo").validate()
    with pytest.raises(ValueError, match="clip_eps"):
        LossConfig("grpo", clip_eps=1.5).validate()


def _trajectory(group, sample, tokens, generated, logprobs, reward, token_advantages=None):
    from k3.posttrain.envs import Task, get_environment
    from k3.posttrain.rollout import Trajectory

    task = Task("t", "math", {"question": "1 + 1?", "answer": "2"}, b0=10.0)
    traj = Trajectory(group, sample, task, "high", get_environment("math")(), list(tokens), list(generated),
                      list(logprobs), prompt_len=generated.index(True), turn_start=generated.index(True))
    traj.done, traj.task_reward, traj.budget_tokens = True, reward, 3
    traj.token_advantages = token_advantages
    return traj


def test_batch_carries_advantages_masks_and_behaviour_logprobs():
    """build_documents/row_tensors: targets are the next tokens, the loss is on generated targets only, each with the
    behaviour log-prob it was sampled with and its advantage (the group's, or the trajectory's own per token)."""
    from k3.posttrain.rl import build_documents, row_tensors
    from k3.posttrain.rollout import Group

    gen = [False, False, True, True, True]
    a = _trajectory(0, 0, [1, 2, 3, 4, 5], gen, [0, 0, -0.1, -0.2, -0.3], 1.0)
    b = _trajectory(0, 1, [1, 2, 6, 7, 8], gen, [0, 0, -1.1, -1.2, -1.3], 0.0)
    c = _trajectory(1, 0, [1, 2, 9, 9, 9], gen, [0, 0, -2.1, -2.2, -2.3], 0.0, token_advantages=[0, 0, 0.5, -0.5, 2.0])
    d = _trajectory(1, 1, [1, 2, 9, 9, 9], gen, [0, 0, -2.1, -2.2, -2.3], 0.0, token_advantages=[0, 0, 1.0, 1.0, 1.0])
    groups = [Group(0, a.task, "high", [a, b]), Group(1, c.task, "high", [c, d])]
    docs = build_documents(groups, [[1.0, 0.0], [0.0, 0.0]], "k3", None)
    t = row_tensors(docs, pad_id=0, replay_shape=None)
    assert t["ids"].tolist() == [[1, 2, 3, 4, 1, 2, 6, 7, 1, 2, 9, 9, 1, 2, 9, 9]]
    assert t["cu_seqlens"].tolist() == [0, 4, 8, 12, 16]
    # input position 1 predicts the first generated token
    assert t["at"].tolist() == [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15]
    assert t["targets"].tolist() == [3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 9, 9]
    assert t["old_logp"].tolist() == [-0.1, -0.2, -0.3, -1.1, -1.2, -1.3, -2.1, -2.2, -2.3, -2.1, -2.2, -2.3]
    assert t["advantages"].tolist() == [0.5] * 3 + [-0.5] * 3 + [0.5, -0.5, 2.0] + [1.0] * 3
    assert t["weights"].tolist() == [1 / 12] * 12
