"""Code tasks checked by unit tests: the reply writes a Python function, the task's asserts run it in a separate,
resource-limited process, and the reward is 1 when every assert passes.

The runner is behind one small interface (`CodeRunner.run(code, tests) -> TestReport`) so the agent sandbox
(`k3.sandbox`) can replace the default `SubprocessRunner` without touching the environment:

- a fresh `python -I` (no user site, no PYTHON* variables) in an empty temporary directory with an empty
  environment, its own session (the whole group is killed on timeout);
- inside, before any candidate code runs, the harness lowers its own limits: CPU seconds, address space, file
  size, open files, no core dumps;
- the harness reads the code and tests from stdin, runs each assert in a copy of the candidate's namespace and
  reports the count on a line prefixed by a per-run random token, so what the candidate prints cannot pass for it.

This is process isolation, not a security boundary (the network and the file system stay reachable); the sandbox
issue's runner is the one for untrusted models at scale.

The code is the reply's first fenced block (```python … ``` or ``` … ```), else its whole response. Tasks come
from parameterised templates (`CODE_TEMPLATES`) whose tests are computed by a reference implementation.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from k3.posttrain.envs import Environment, Prompt, Task, register


@dataclass
class TestReport:
    passed: int
    total: int
    error: str | None = None  # "timeout", "crash: …", "syntax: …"

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


class CodeRunner(Protocol):
    def run(self, code: str, tests: list[str]) -> TestReport: ...


_HARNESS = r"""
import json, resource, sys
spec = json.loads(sys.stdin.read())
for name, value in spec["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
token, passed, error = spec["token"], 0, None
namespace = {"__name__": "candidate"}
try:
    exec(compile(spec["code"], "candidate.py", "exec"), namespace)
except BaseException as e:
    error = f"{type(e).__name__}: {e}"[:200]
if error is None:
    for test in spec["tests"]:
        try:
            exec(compile(test, "test.py", "exec"), dict(namespace))
            passed += 1
        except BaseException:
            pass
sys.stdout.flush()
print("\n" + token + json.dumps({"passed": passed, "error": error}), flush=True)
"""


class SubprocessRunner:
    """Runs candidate code and its asserts in a resource-limited child process (see the module docstring)."""

    def __init__(self, cpu_seconds: int = 5, memory_bytes: int = 1 << 30, file_bytes: int = 1 << 20,
                 wall_seconds: float = 10.0, output_bytes: int = 1 << 16):
        self.limits = {"RLIMIT_CPU": cpu_seconds, "RLIMIT_AS": memory_bytes, "RLIMIT_FSIZE": file_bytes,
                       "RLIMIT_NOFILE": 64, "RLIMIT_CORE": 0}
        self.wall_seconds = wall_seconds
        self.output_bytes = output_bytes

    def run(self, code: str, tests: list[str]) -> TestReport:
        token = "K3RESULT-" + secrets.token_hex(16) + ":"
        spec = json.dumps({"code": code, "tests": tests, "token": token, "limits": self.limits})
        with tempfile.TemporaryDirectory(prefix="k3-code-") as cwd:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _HARNESS], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=cwd,
                                    env={"PATH": os.defpath}, start_new_session=True)
            try:
                out, _ = proc.communicate(spec.encode(), timeout=self.wall_seconds)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                return TestReport(0, len(tests), "timeout")
        text = out[-self.output_bytes:].decode(errors="replace")
        lines = [line for line in text.splitlines() if line.startswith(token)]
        if not lines:
            return TestReport(0, len(tests), f"crash: exit code {proc.returncode}")
        result = json.loads(lines[-1][len(token):])
        return TestReport(result["passed"], len(tests), result["error"])


_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(reply: str) -> str:
    """The first fenced code block of `reply`, else all of it."""
    found = _FENCE.search(reply or "")
    return found.group(1) if found else (reply or "")


@dataclass
class CodeTemplate:
    """A family of tasks: `describe(c)` the request for constant c, `reference(c)` a correct function, `inputs` the
    argument tuples its asserts call it with."""

    name: str
    describe: Callable[[Any], str]
    reference: Callable[[Any], Callable]
    constants: Callable[[random.Random], Any]
    inputs: Callable[[random.Random], list[tuple]]


def _ints(rng: random.Random, n: int = 4) -> list[tuple]:
    return [(rng.randint(-50, 50),) for _ in range(n)]


def _lists(rng: random.Random, n: int = 4) -> list[tuple]:
    return [([rng.randint(-20, 20) for _ in range(rng.randint(0, 6))],) for _ in range(n)]


def _words(rng: random.Random, n: int = 4) -> list[tuple]:
    vocab = ["apple", "kiwi", "fig", "plum", "pear", "lime", "date"]
    return [(" ".join(rng.choice(vocab) for _ in range(rng.randint(1, 4))),) for _ in range(n)]


CODE_TEMPLATES = [
    CodeTemplate("add_const", lambda c: f"Write a Python function add_const(x) that returns x plus {c}.",
                 lambda c: lambda x: x + c, lambda r: r.randint(1, 20), _ints),
    CodeTemplate("mul_const", lambda c: f"Write a Python function mul_const(x) that returns x times {c}.",
                 lambda c: lambda x: x * c, lambda r: r.randint(2, 9), _ints),
    CodeTemplate("sum_above", lambda c: f"Write a Python function sum_above(xs) that returns the sum of the "
                                        f"numbers in the list xs that are greater than {c}.",
                 lambda c: lambda xs: sum(x for x in xs if x > c), lambda r: r.randint(-5, 5), _lists),
    CodeTemplate("count_div", lambda c: f"Write a Python function count_div(xs) that returns how many numbers in "
                                        f"the list xs are divisible by {c}.",
                 lambda c: lambda xs: sum(1 for x in xs if x % c == 0), lambda r: r.randint(2, 5), _lists),
    CodeTemplate("first_n", lambda c: f"Write a Python function first_n(xs) that returns the first {c} elements "
                                      f"of the list xs (all of them if it is shorter).",
                 lambda c: lambda xs: xs[:c], lambda r: r.randint(1, 4), _lists),
    CodeTemplate("repeat_word", lambda c: f"Write a Python function repeat_word(s) that returns the string s "
                                          f"repeated {c} times.",
                 lambda c: lambda s: s * c, lambda r: r.randint(2, 4), _words),
    CodeTemplate("reverse_words", lambda c: "Write a Python function reverse_words(s) that returns the words of "
                                            "the string s in reverse order, joined by single spaces.",
                 lambda c: lambda s: " ".join(reversed(s.split())), lambda r: 0, _words),
    CodeTemplate("clamp", lambda c: f"Write a Python function clamp(x) that returns x limited to the range "
                                    f"{-c} to {c}.",
                 lambda c: lambda x: max(-c, min(c, x)), lambda r: r.randint(5, 30), _ints),
]


def make_code_task(template: CodeTemplate, rng: random.Random, task_id: str, env: str) -> Task:
    c = template.constants(rng)
    fn = template.reference(c)
    tests = [f"assert {template.name}({', '.join(map(repr, args))}) == {fn(*args)!r}" for args in template.inputs(rng)]
    return Task(task_id, env, {"prompt": template.describe(c), "entry": template.name, "tests": tests})


@register("code")
class CodeEnvironment(Environment):
    runner: CodeRunner = SubprocessRunner()

    @classmethod
    def make_tasks(cls, n: int, seed: int) -> list[Task]:
        rng = random.Random(seed)
        return [make_code_task(CODE_TEMPLATES[i % len(CODE_TEMPLATES)], rng, f"code-{seed}-{i}", cls.name)
                for i in range(n)]

    def reset(self, task: Task) -> Prompt:
        self.task, self.replies = task, []
        tests = task.data.get("tests")
        if not isinstance(task.data.get("prompt"), str) or not isinstance(tests, list) or not tests:
            raise ValueError(f"code task {task.id}: needs a string prompt and a non-empty list of tests")
        return Prompt([{"role": "user", "content": task.data["prompt"]}])

    def verify(self) -> float:
        if not self.replies:
            return 0.0
        report = self.runner.run(extract_code(self.replies[-1]["content"]), list(self.task.data["tests"]))
        return float(report.all_passed)
