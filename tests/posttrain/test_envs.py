"""Every environment's verifier on known right and wrong answers (the code environment's also in a sandbox), the
tools, the registry, task files and episode state. The program runners' limits, isolation and unforgeable assert
report are tested once, in tests/sandbox/test_programs.py."""

import json
import shutil
import sys
import tempfile
import textwrap

import pytest

from k3.chat.template import Reply, ToolCall
from k3.posttrain.envs import (ENVIRONMENTS, Environment, Prompt, Task, TaskSampler, get_environment, load_tasks,
                               register, split_tasks)
from k3.posttrain.envs.code import CodeEnvironment, extract_code
from k3.posttrain.envs.math import answers_match, final_number
from k3.posttrain.envs.tools import calculate, call_tool


def _reply(content, reasoning="", calls=()):
    return Reply(content, reasoning, [ToolCall(f"call_{i}", name, json.dumps(args)) for i, (name, args) in
                                      enumerate(calls)])


def _score(env_name, task, *replies):
    env = get_environment(env_name)()
    env.reset(task)
    observations = [env.step(r) for r in replies]
    return env.verify(), observations


# ---- math


def test_math_verifier_right_and_wrong():
    task = Task("t", "math", {"question": "What is 3 * 4 - 1?", "answer": "11"})
    assert _score("math", task, _reply("The answer is 11."))[0] == 1.0
    assert _score("math", task, _reply("3 * 4 = 12, minus 1 gives 11"))[0] == 1.0
    assert _score("math", task, _reply("The answer is 12."))[0] == 0.0
    assert _score("math", task, _reply("I do not know."))[0] == 0.0
    # the thinking is not read: a right number only there does not count
    assert _score("math", task, _reply("", reasoning="so 11"))[0] == 0.0
    # no reply at all (an episode cut off before answering)
    env = get_environment("math")()
    env.reset(task)
    assert env.verify() == 0.0


def test_math_answers_compare_exactly():
    assert answers_match("it is 1/2", "0.5") and answers_match("0.50", "1/2") and answers_match("2/4", "0.5")
    assert answers_match("total: 1,234", "1234") and answers_match("-7", "-7")
    assert not answers_match("0.33", "1/3") and not answers_match("7", "-7")
    assert final_number("5 apples and 3 pears make 8 fruit.") == 8


def test_task_difficulties_and_kinds_narrow_the_generators():
    math = get_environment("math")
    # the default mixture: arithmetic and word problems in turn, difficulties 1, 2, 3 for each kind in turn
    default = math.make_tasks(12, seed=0)
    assert [(t.data["kind"], t.data["difficulty"]) for t in default[:6]] == [
        ("arithmetic", 1), ("word", 1), ("arithmetic", 2), ("word", 2), ("arithmetic", 3), ("word", 3)]
    sums = math.make_tasks(8, seed=1, difficulties=[1], kinds=["sums"])
    assert all(t.data["kind"] == "sums" and t.data["difficulty"] == 1 for t in sums)
    for t in sums:  # two one-digit numbers
        a, b = (int(x) for x in __import__("re").findall(r"\d+", t.data["question"])[:2])
        assert a < 10 and b < 10 and int(t.data["answer"]) == a + b
        assert _score("math", t, _reply(f"The answer is {t.data['answer']}."))[0] == 1.0
    assert [t.data["question"] for t in math.make_tasks(8, seed=2, kinds=["sums"], difficulties=[1])] != \
        [t.data["question"] for t in sums]
    strings = get_environment("strings").make_tasks(4, seed=0, difficulties=[2])
    assert strings != get_environment("strings").make_tasks(4, seed=0)
    with pytest.raises(ValueError, match="kinds must be some of arithmetic, sums, word"):
        math.make_tasks(2, 0, kinds=["poetry"])
    with pytest.raises(ValueError, match="difficulties must be some of 1, 2, 3"):
        math.make_tasks(2, 0, difficulties=[4])
    with pytest.raises(ValueError, match="no kinds"):
        get_environment("tools").make_tasks(2, 0, kinds=["sums"])
    with pytest.raises(ValueError, match="no difficulties or kinds"):
        get_environment("code").make_tasks(2, 0, difficulties=[1])


def test_make_tasks_command_writes_a_task_file_rl_reads(tmp_path):
    import subprocess

    out = tmp_path / "train.jsonl"
    done = subprocess.run([sys.executable, "-m", "k3.cli", "data", "make-tasks", "--env", "math", "--kinds", "sums",
                           "--difficulties", "1,2", "--tasks", "6", "--seed", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    tasks = load_tasks(out)
    assert tasks == get_environment("math").make_tasks(6, 3, difficulties=[1, 2], kinds=["sums"])
    bad = subprocess.run([sys.executable, "-m", "k3.cli", "data", "make-tasks", "--env", "code", "--difficulties",
                          "1", "--out", str(tmp_path / "x.jsonl")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no difficulties or kinds" in bad.stderr


def test_math_tasks_come_from_the_sft_generators():
    tasks = get_environment("math").make_tasks(6, seed=3)
    assert len({t.id for t in tasks}) == 6 and all(t.env == "math" for t in tasks)
    assert tasks == get_environment("math").make_tasks(6, seed=3)
    for t in tasks:
        assert _score("math", t, _reply(f"The answer is {t.data['answer']}."))[0] == 1.0
    with pytest.raises(ValueError, match="numeric answer"):
        get_environment("math")().reset(Task("x", "math", {"question": "q", "answer": "many"}))


# ---- code


def test_code_verifier_right_and_wrong():
    task = get_environment("code").make_tasks(1, seed=0)[0]  # add_const
    c = int(task.data["prompt"].split("plus ")[1].rstrip("."))
    right = f"Here it is:\n```python\ndef add_const(x):\n    return x + {c}\n```\nDone."
    assert _score("code", task, _reply(right))[0] == 1.0
    assert _score("code", task, _reply("```python\ndef add_const(x):\n    return x\n```"))[0] == 0.0
    assert _score("code", task, _reply("def add_const(x) return"))[0] == 0.0  # a syntax error


def test_code_verifier_in_a_sandbox(monkeypatch):
    """The same environment with every candidate in a fresh sandbox: one class attribute changes."""
    from k3.sandbox.programs import SandboxRunner

    folder = tempfile.mkdtemp(prefix="k3-sandbox-test-")  # not under pytest's 0700 folders: the sandbox uid reads it
    runner = None
    try:
        try:
            runner = SandboxRunner(folder)
        except (RuntimeError, OSError) as e:
            pytest.skip(f"sandboxes cannot run here: {e}")
        task = Task("where", "code", {"prompt": "?", "tests": ["import os\nassert os.getcwd() == '/home/user'"]})
        assert _score("code", task, _reply("x = 1"))[0] == 0.0  # the default runs on the host
        monkeypatch.setattr(CodeEnvironment, "programs", runner)
        assert _score("code", task, _reply("x = 1"))[0] == 1.0
        test_code_verifier_right_and_wrong()
    finally:
        if runner is not None:
            runner.manager.close(kill_all=True)
        shutil.rmtree(folder, ignore_errors=True)


def test_extract_code():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```\ny\n```") == "x = 1\n"
    assert extract_code("```\ny = 2\n```") == "y = 2\n"
    assert extract_code("z = 3") == "z = 3"


# ---- tools


def test_tools_episode_right_and_wrong():
    task = get_environment("tools").make_tasks(1, seed=0)[0]
    item = next(k for k in task.data["table"] if f"'{k}'" in task.data["question"])
    count = int(task.data["question"].split("How much do ")[1].split()[0])
    price = task.data["table"][item]
    env = get_environment("tools")()
    prompt = env.reset(task)
    assert [t["function"]["name"] for t in prompt.tools] == ["lookup", "calculator"]
    obs = env.step(_reply("", calls=[("lookup", {"key": item})]))
    assert obs == [{"role": "tool", "tool_call_id": "call_0", "content": str(price)}]
    obs = env.step(_reply("", calls=[("calculator", {"expression": f"{count}*{price}"})]))
    assert obs[0]["content"] == str(count * price)
    assert env.step(_reply(f"The answer is {count * price}.")) is None
    assert env.verify() == 1.0
    assert _score("tools", task, _reply(f"The answer is {count * price + 1}."))[0] == 0.0
    # an episode that never stops calling tools has not answered
    assert _score("tools", task, _reply("", calls=[("lookup", {"key": item})]))[0] == 0.0


def test_tools_are_deterministic_and_safe():
    table = {"kiwi": 7}
    assert call_tool("lookup", '{"key": "Kiwi"}', table) == "7"
    assert call_tool("lookup", '{"key": "fig"}', table).startswith("error")
    assert call_tool("calculator", '{"expression": "3*(4+1)/2"}', table) == "7.5"
    assert call_tool("calculator", '{"expression": "__import__(\'os\')"}', table).startswith("error")
    assert call_tool("calculator", "not json", table).startswith("error")
    assert call_tool("search", "{}", table).startswith("error")
    assert calculate("10 / 4") == "2.5" and calculate("-(2 - 5) * 3") == "9"
    with pytest.raises(ValueError):
        calculate("2 ** 100000")


# ---- the interface


def test_registry_and_one_file_environments(tmp_path, monkeypatch):
    assert {"math", "code", "tools"} <= set(ENVIRONMENTS)
    with pytest.raises(ValueError, match="unknown environment"):
        get_environment("nope")

    @register("echo-test")
    class Echo(Environment):
        def reset(self, task):
            self.task, self.replies = task, []
            return Prompt([{"role": "user", "content": task.data["say"]}])

        def verify(self):
            return float(bool(self.replies) and self.replies[-1]["content"] == self.task.data["say"])

    try:
        assert get_environment("echo-test") is Echo
        assert _score("echo-test", Task("e", "echo-test", {"say": "hi"}), _reply("hi"))[0] == 1.0
    finally:
        del ENVIRONMENTS["echo-test"]
    # one defined outside the package, by module path
    (tmp_path / "my_env.py").write_text(textwrap.dedent("""
        from k3.posttrain.envs import Environment, Prompt

        class Mine(Environment):
            def reset(self, task):
                return Prompt([{"role": "user", "content": "?"}])

            def verify(self):
                return 1.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert get_environment("my_env:Mine").__name__ == "Mine"
    with pytest.raises(ValueError, match="cannot import"):
        get_environment("my_env:Missing")
    sys.modules.pop("my_env", None)


def test_episode_state_round_trips():
    task = get_environment("tools").make_tasks(1, seed=1)[0]
    env = get_environment("tools")()
    env.reset(task)
    env.step(_reply("", calls=[("lookup", {"key": "kiwi"})]))
    state = json.loads(json.dumps(env.state_dict()))
    copy = get_environment("tools")()
    copy.load_state_dict(state)
    assert copy.task == task and copy.replies == env.replies and copy.verify() == env.verify()


def test_task_files_and_sampler(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [Task(f"m{i}", "math", {"question": f"{i} + 1?", "answer": str(i + 1)}, b0=10.0 + i).to_json()
            for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tasks = load_tasks(path, {"math": get_environment("math")})
    assert [t.b0 for t in tasks] == [10.0, 11.0, 12.0, 13.0, 14.0]
    train, held = split_tasks(tasks, 2, seed=0)
    assert len(train) == 3 and len(held) == 2 and {t.id for t in train + held} == {t.id for t in tasks}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_tasks(bad)
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="appears twice"):
        load_tasks(bad)
    bad.write_text(json.dumps({**rows[0], "env": "code"}) + "\n")
    with pytest.raises(ValueError, match="not one of this run"):
        load_tasks(bad, {"math": get_environment("math")})
    sampler = TaskSampler(tasks, seed=1)
    first = [sampler.next().id for _ in range(7)]
    assert sorted(first[:5]) == sorted(t.id for t in tasks)  # one pass draws each task once
    state = sampler.state_dict()
    rest = [sampler.next().id for _ in range(4)]
    again = TaskSampler(tasks, seed=1)
    again.load_state_dict(state)
    assert [again.next().id for _ in range(4)] == rest
