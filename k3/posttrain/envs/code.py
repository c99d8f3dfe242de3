"""Code tasks checked by unit tests: the reply writes a Python function, the task's asserts run it in a separate,
resource-limited program, and the reward is 1 when every assert passes.

The asserts run through `k3.sandbox.programs.run_asserts` (the one place k3 runs generated programs, shared with
HumanEval): a fresh `python -I` in an empty folder with an empty environment, its own session killed at the wall
limit, CPU, memory, file-size and open-file limits, and a report line tagged by a per-run random token so what
the candidate prints cannot pass for it (docs/sandbox.md, "Running generated programs").

Where it runs is the class attribute `programs`, a `k3.sandbox.programs.ProgramRunner`. The default is the plain
subprocess runner: it needs no root, and a sandbox manager owns its state folder (it adopts, and stops the commands
of, what it finds there), so every training process would need a folder of its own. A subclass (or a launcher)
that sets `programs = SandboxRunner(state_dir)` runs each candidate in a fresh sandbox instead: no network, its
own filesystem, a memory cgroup and a pids limit.

The code is the reply's first fenced block (```python … ``` or ``` … ```), else its whole response. Tasks come
from parameterised templates (`CODE_TEMPLATES`) whose tests are computed by a reference implementation.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from k3.posttrain.envs import Environment, Prompt, Task, register
from k3.sandbox.programs import Limits, ProgramRunner, SubprocessRunner, run_asserts

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
    programs: ClassVar[ProgramRunner] = SubprocessRunner()  # where candidates run (see the module docstring)
    # 5 CPU seconds, 10 s wall clock, 1 GiB address space, 1 MiB files, 64 open files, 16 MiB of output
    limits: ClassVar[Limits] = Limits(wall_seconds=10.0, cpu_seconds=5, memory_mb=1024, file_bytes=1 << 20)

    @classmethod
    def make_tasks(cls, n: int, seed: int, difficulties: Sequence[int] | None = None,
                   kinds: Sequence[str] | None = None) -> list[Task]:
        if difficulties is not None or kinds is not None:
            raise ValueError("the code environment's tasks have no difficulties or kinds to choose from")
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
        report = run_asserts(self.programs, extract_code(self.replies[-1]["content"]), list(self.task.data["tests"]),
                             self.limits)
        return float(report.all_passed)
