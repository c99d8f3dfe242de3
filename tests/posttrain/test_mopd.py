"""`k3 mopd` on the debug preset: the per-token reward (clip, stop-gradient), routing by (domain, effort), the
teacher's own context, the packed scorer against a plain forward, a student equal to its teacher, and the command
end to end with two teachers (checkpoints, resume, refusals)."""

import json
import random
from types import SimpleNamespace

import pytest
import torch

from k3.chat.template import ChatTemplate, Reply
from k3.checkpoint import load_trained, save_checkpoint
from k3.cli import main
from k3.config import get_preset
from k3.model.model import build_model
from k3.posttrain.envs import Task, get_environment
from k3.posttrain.envs.strings import final_answer
from k3.posttrain.mopd import (DEFAULT_LR, MOPDConfig, Teacher, TeacherScorer, distillation_advantages,
                               distillation_rl_config, teacher_sequence)
from k3.posttrain.rl import RLConfig, build_documents, pack_rows, row_tensors
from k3.posttrain.rl_loss import LossConfig, policy_loss
from k3.posttrain.rollout import Group, Trajectory
from k3.train.metrics import MetricsLog

ENVS = {"math": get_environment("math"), "strings": get_environment("strings")}


pytestmark = pytest.mark.usefixtures("one_thread")


def _save_run(root, tokenizer, name, seed):
    """A debug-preset run folder whose stop-token row is scaled, so replies end at varied lengths."""
    tokenizer.save(root / "tokenizer")
    cfg = get_preset("debug").replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                      eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    model = build_model(cfg, seed=seed)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_id] *= 15
    save_checkpoint(root / name / "checkpoints", 1, model.state_dict(), {},
                    {"config.json": json.dumps(cfg.to_config_json())}, {"tokenizer": root / "tokenizer"})
    return root / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer):
    """The student and two teachers: three debug models of different seeds sharing the tokenizer."""
    root = tmp_path_factory.mktemp("mopd")
    return {name: _save_run(root, tokenizer, name, seed) for name, seed in (("student", 0), ("math", 1),
                                                                              ("strings", 2))}


def _trajectory(template, task, effort, reply):
    env = ENVS[task.env]()
    prompt = env.reset(task)
    ids = template.render(prompt.messages, tools=prompt.tools, reasoning_effort=effort)
    n = len(ids)
    return Trajectory(0, 0, task, effort, env, ids + reply, [False] * n + [True] * len(reply),
                      [0.0] * (n + len(reply)), n, n, done=True, num_generated=len(reply))


def _groups(template, vocab, pairs, per_group=2, seed=0):
    """Groups of trajectories with random replies, one group per (task, effort)."""
    rng = random.Random(seed)
    groups = []
    for uid, (task, effort) in enumerate(pairs):
        trajs = [_trajectory(template, task, effort, [rng.randrange(vocab) for _ in range(rng.randint(3, 9))])
                 for _ in range(per_group)]
        groups.append(Group(uid, task, effort, trajs))
    return groups


def _tasks():
    return ENVS["math"].make_tasks(2, 0) + ENVS["strings"].make_tasks(2, 0)


def _fake_run(student, template):
    return SimpleNamespace(model=student, runtime=SimpleNamespace(device=torch.device("cpu")), template=template,
                           envs=ENVS)


def _reference_logprobs(model, tokens, scored):
    """log π at the scored positions from one plain forward of the whole sequence (no packing)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return torch.stack([logp[i - 1, tokens[i]] for i in range(1, len(tokens)) if scored[i]])


def test_strings_environment():
    tasks = ENVS["strings"].make_tasks(9, 0)
    assert tasks == ENVS["strings"].make_tasks(9, 0) and len({t.id for t in tasks}) == 9
    assert {t.data["question"] for t in tasks} != {t.data["question"] for t in ENVS["strings"].make_tasks(9, 1)}

    def score(task, content, reasoning="thinking"):
        env = ENVS["strings"]()
        assert env.reset(task).messages == [{"role": "user", "content": task.data["question"]}]
        env.step(Reply(content, reasoning, []))
        return env.verify()

    for task in tasks:
        assert score(task, f"The answer is {task.data['answer']}.") == 1.0
        assert score(task, f"The answer is {task.data['answer']}x.") == 0.0
        assert score(task, None) == 0.0  # a reply cut inside its think channel
    task = Task("t", "strings", {"question": "Sort 3, 1, 2.", "answer": "1, 2, 3"})
    assert score(task, "I sorted.  The answer is 1,  2, 3.") == 1.0
    assert score(task, "The answer is 3, 2, 1. No wait, the answer is 1, 2, 3") == 1.0
    assert score(Task("n", "strings", {"question": "q", "answer": "12"}), "The answer is 12.0.") == 1.0
    assert final_answer("just olleh") == "just olleh"
    with pytest.raises(ValueError, match="non-empty string answer"):
        ENVS["strings"]().reset(Task("bad", "strings", {"question": "q", "answer": 3}))


def test_reward_is_clipped_and_stops_gradients():
    teacher = torch.tensor([-1.0, -9.0, -0.5, -2.0, -7.0], dtype=torch.float64, requires_grad=True)
    student = torch.tensor([-3.0, -1.0, -0.5, -8.5, -4.0], dtype=torch.float64, requires_grad=True)
    r = distillation_advantages(teacher, student, r_max=3.0)
    assert r.tolist() == [2.0, -3.0, 0.0, 3.0, -3.0]  # 2, −8 → −3, 0, 6.5 → 3, −3 exactly at the bound
    assert not r.requires_grad
    # in the loss, the reward is a constant: the student's gradient is the one with r given as plain numbers, and
    # nothing flows into the teacher's log-probs
    weights = torch.full((5,), 0.2, dtype=torch.float64)
    loss, _ = policy_loss(student, student.detach(), distillation_advantages(teacher, student, 3.0), weights,
                          LossConfig())
    loss.backward()
    assert teacher.grad is None
    constant = student.detach().clone().requires_grad_(True)
    ref, _ = policy_loss(constant, constant.detach(), torch.tensor([2.0, -3.0, 0.0, 3.0, -3.0],
                                                                  dtype=torch.float64), weights, LossConfig())
    ref.backward()
    torch.testing.assert_close(student.grad, constant.grad, rtol=0, atol=0)


def test_teacher_spec_and_routing(runs):
    t = Teacher.parse(f"math:high={runs['math']}")
    assert (t.domain, t.effort, t.run, t.format_effort, t.key) == ("math", "high", str(runs["math"]), "high",
                                                                  "math:high")
    assert Teacher.parse(f"strings:low={runs['strings']}@max").format_effort == "max"
    for bad, match in (("math=x", "DOMAIN:EFFORT=RUN"), ("math:medium=x", "unknown effort"),
                       ("poetry:low=x", "unknown environment"), ("math:high=", "DOMAIN:EFFORT=RUN")):
        with pytest.raises(ValueError, match=match):
            Teacher.parse(bad)
    base = RLConfig(init_from=str(runs["student"]))
    with pytest.raises(ValueError, match="two teachers for math:high"):
        MOPDConfig(base, [t, Teacher.parse("math:high=y")]).validate()
    with pytest.raises(ValueError, match="at least one teacher"):
        MOPDConfig(base, []).validate()
    with pytest.raises(ValueError, match="r_max"):
        MOPDConfig(base, [t], r_max=0.0).validate()
    teachers = [t, Teacher("math", "low", "m-low"), Teacher("strings", "low", "s-low")]
    rl_cfg = distillation_rl_config(MOPDConfig(base, teachers))
    assert rl_cfg.envs == ["math", "strings"] and rl_cfg.efforts == ["low", "high"]
    scorer = TeacherScorer(teachers, {}, 5.0, 256)
    assert scorer.route("math", "high") is teachers[0] and scorer.route("strings", "low") is teachers[2]
    with pytest.raises(ValueError, match="no teacher for domain 'strings' at effort 'high'"):
        scorer.route("strings", "high")
    math_task, strings_task = Task("m", "math", {}), Task("s", "strings", {})
    assert [scorer.effort(math_task, uid) for uid in range(4)] == ["low", "high", "low", "high"]
    assert {scorer.effort(strings_task, uid) for uid in range(4)} == {"low"}
    with pytest.raises(ValueError, match="no teacher for domain 'code'"):
        scorer.effort(Task("c", "code", {}), 0)


def test_scorer_routes_each_sample_to_its_teacher(runs, tokenizer):
    """Per-token advantages equal clip(log π_T − log π_θ) from plain forwards, with the teacher of the sample's
    (domain, effort) in its own context; the packed scoring equals one forward per sequence; the teachers get no
    gradient from a training step on those advantages."""
    template = ChatTemplate(tokenizer)
    student, _, _ = load_trained(runs["student"])
    teacher_math, _, _ = load_trained(runs["math"])
    teacher_strings, _, _ = load_trained(runs["strings"])
    for p in list(teacher_math.parameters()) + list(teacher_strings.parameters()):
        p.requires_grad_(True)
    teachers = [Teacher("math", "high", str(runs["math"])), Teacher("strings", "low", str(runs["strings"]), "max")]
    scorer = TeacherScorer(teachers, {"math:high": teacher_math, "strings:low": teacher_strings}, r_max=1.5,
                           row_tokens=96)
    m1, m2, s1, s2 = _tasks()
    groups = _groups(template, tokenizer.vocab_size, [(m1, "high"), (s1, "low"), (m2, "high"), (s2, "low")])
    metrics = scorer(_fake_run(student, template), groups)
    clipped = 0
    for g in groups:
        model = teacher_math if g.task.env == "math" else teacher_strings
        for traj in g.trajectories:
            tokens, scored = teacher_sequence(template, ENVS, traj, "high" if g.task.env == "math" else "max")
            if g.task.env == "strings":  # the teacher's context is its own: rendered at max, the reply unchanged
                assert tokens[:traj.prompt_len] != traj.tokens[:traj.prompt_len]
                assert tokens[-traj.num_generated:] == traj.tokens[-traj.num_generated:]
            else:
                assert tokens == traj.tokens
            want = (_reference_logprobs(model, tokens, scored)
                    - _reference_logprobs(student, traj.tokens, traj.generated)).clamp(-1.5, 1.5)
            got = torch.tensor([traj.token_advantages[i] for i in range(1, len(traj.tokens)) if traj.generated[i]],
                               dtype=torch.float64)
            torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
            assert all(a == 0.0 for a, gen in zip(traj.token_advantages, traj.generated) if not gen)
            clipped += int((want.abs() >= 1.5 - 1e-9).sum())
    assert clipped > 0  # random replies: some tokens hit R_max
    assert set(metrics["teachers"]) == {"math:high", "strings:low"}
    assert metrics["teachers"]["math:high"]["n"] == 4 and 0 < metrics["advantage_clip_fraction"] <= 1
    # a training step on these advantages moves the student only
    docs = build_documents(groups, [[0.0] * 2 for _ in groups], "k3", None)
    student.train()
    for row in pack_rows(docs, 96):
        t = row_tensors(row, tokenizer.pad_id, None)
        logits = student(t["ids"], cu_seqlens=t["cu_seqlens"], logits_at=t["at"]).logits
        logp = torch.log_softmax(logits.float(), -1).gather(1, t["targets"][:, None]).squeeze(1)
        loss, _ = policy_loss(logp, t["old_logp"], t["advantages"], t["weights"], LossConfig())
        loss.backward()
    assert any(p.grad is not None for p in student.parameters())
    assert all(p.grad is None for p in list(teacher_math.parameters()) + list(teacher_strings.parameters()))


def test_student_equal_to_its_teacher_gets_zero_advantage(runs, tokenizer):
    template = ChatTemplate(tokenizer)
    student, _, _ = load_trained(runs["student"])
    same, _, _ = load_trained(runs["student"])
    teachers = [Teacher("math", "high", str(runs["student"])), Teacher("strings", "high", str(runs["student"]))]
    scorer = TeacherScorer(teachers, {"math:high": same, "strings:high": same}, r_max=5.0, row_tokens=64)
    m1, m2, s1, s2 = _tasks()
    groups = _groups(template, tokenizer.vocab_size, [(m1, "high"), (m2, "high"), (s1, "high"), (s2, "high")],
                     per_group=3, seed=1)
    metrics = scorer(_fake_run(student, template), groups)
    assert all(a == 0.0 for g in groups for t in g.trajectories for a in t.token_advantages)
    assert metrics["advantage"] == 0.0 and metrics["teacher_kl"] == 0.0


def _records(out, kind="rl"):
    return [r for r in MetricsLog(out / "metrics.jsonl").read() if r["kind"] == kind]


def test_mopd_command_two_teachers_checkpoints_and_resumes(runs, tmp_path, capsys):
    out = tmp_path / "mopd"
    common = ["--student", str(runs["student"]), "--teacher", f"math:high={runs['math']}",
              "--teacher", f"strings:low={runs['strings']}", "--out", str(out)]
    small = ["--prompts", "2", "--samples", "2", "--max-tokens", "10", "--num-tasks", "4", "--heldout-tasks", "1",
             "--partial", "0.5", "--eval-every", "2", "--checkpoint-every", "1", "--r-max", "2", "--device", "cpu"]
    assert main(["mopd", *common, "--iterations", "2", *small]) == 0
    assert "MOPD: 2 iterations" in capsys.readouterr().out
    info = json.loads((out / "run.json").read_text())
    assert info["mopd_config"]["r_max"] == 2.0
    assert info["rl_config"]["lr"] == DEFAULT_LR  # MOPD's own default, not RL's
    assert [t["domain"] + ":" + t["effort"] for t in info["mopd_config"]["teachers"]] == ["math:high", "strings:low"]
    assert info["rl_config"]["envs"] == ["math", "strings"] and info["rl_config"]["efforts"] == ["low", "high"]
    tasks = [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]
    assert {t["env"] for t in tasks} == {"math", "strings"} and {t["b0"] for t in tasks} == {10.0}
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2]
    seen = set()
    for r in records:
        seen |= set(r["teachers"])
        for effort in r["efforts"]:  # every group was sampled at an effort its domain has a teacher for
            assert effort in ("low", "high")
        for m in r["teachers"].values():
            assert -2.0 <= m["advantage"] <= 2.0 and m["n"] > 0
    assert seen <= {"math:high", "strings:low"} and seen
    assert [r["step"] for r in _records(out, "rl_eval")] == [0, 2]
    assert {"mopd.png", "rl_rollouts.png", "rl_heldout.png"} <= {p.name for p in (out / "plots").iterdir()}
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    trained, _, _ = load_trained(out)
    start, _, _ = load_trained(runs["student"])
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), start.state_dict().values()))
    # a resume needs only the folder; other teachers or another R_max are refused
    assert main(["mopd", "--out", str(out), "--resume", "--iterations", "3"]) == 0
    assert "3 iterations (resumed at iteration 2)" in capsys.readouterr().out
    assert [r["step"] for r in _records(out)] == [1, 2, 3]
    assert main(["mopd", "--out", str(out), "--resume", "--iterations", "4", "--r-max", "3"]) == 2
    assert "other teachers or R_max" in capsys.readouterr().err
    assert main(["mopd", *common, *small]) == 2
    assert "already holds an RL run" in capsys.readouterr().err
    assert main(["mopd", "--student", str(runs["student"]), "--out", str(tmp_path / "x")]) == 2
    assert "at least one teacher" in capsys.readouterr().err
    assert main(["mopd", "--student", str(runs["student"]), "--teacher", f"math:high={tmp_path / 'none'}",
                 "--out", str(tmp_path / "y")]) == 2
    assert "neither a checkpoint folder" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
