"""RL environments: one interface, a registry, and the tasks they pose (K3 report §4.2).

An `Environment` instance is one episode of one task:

    prompt = env.reset(task)          -> Prompt: the chat messages (and tool declarations) the policy answers
    obs = env.step(reply)             -> the messages the environment answers with (tool results), or None: done
    reward = env.verify()             -> the task reward in [0, 1], from what the episode did

`reply` is the policy's parsed assistant turn (`k3.chat.template.Reply`: content, reasoning, tool calls); the
rollout (`k3.posttrain.rollout`) renders prompts and observations with the chat template and keeps the token ids
the policy generated exactly as they were sampled. An episode ends when `step` returns None or its turn limit
(`max_turns`) or token limit is reached. `agentic` environments count every generated token against the budget
(`k3.posttrain.budget`); the others count the thinking tokens.

Adding an environment takes one file in this folder: a subclass decorated with `@register("name")`, which
`k3 rl --env name` then finds (every module here is imported with the package). One defined elsewhere is named
as `--env package.module:ClassName`. Episode state must be plain JSON values (`state_dict`), because paused
episodes travel between processes and into checkpoints.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from k3.chat.template import Reply


@dataclass
class Task:
    """One problem. `data` is the environment's (question, answer, tests...); `b0` the mean budget tokens of the
    cold-start model's samples (None until estimated)."""

    id: str
    env: str
    data: dict[str, Any]
    b0: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "env": self.env, "data": self.data, "b0": self.b0}

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "task") -> Task:
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or not isinstance(obj.get("env"), str) \
                or not isinstance(obj.get("data"), dict):
            raise ValueError(f"{where}: a task is an object with string id and env and an object data")
        b0 = obj.get("b0")
        if b0 is not None and not (isinstance(b0, (int, float)) and b0 > 0):
            raise ValueError(f"{where}: b0 must be a positive number, got {b0!r}")
        return cls(obj["id"], obj["env"], obj["data"], None if b0 is None else float(b0))


@dataclass
class Prompt:
    """What the policy sees first: OpenAI-style messages and, for tool use, the tool declarations."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


class Environment:
    """Base class: subclasses set `name` (through `register`) and implement `make_tasks`, `reset`, `step` and
    `verify`; `step`'s default ends the episode after one reply."""

    name: ClassVar[str] = ""
    agentic: ClassVar[bool] = False
    max_turns: ClassVar[int] = 1

    def __init__(self) -> None:
        self.task: Task | None = None
        self.replies: list[dict[str, Any]] = []  # every assistant turn, as {content, reasoning, tool_calls}

    @classmethod
    def make_tasks(cls, n: int, seed: int, difficulties: Sequence[int] | None = None,
                   kinds: Sequence[str] | None = None) -> list[Task]:
        """`n` generated tasks (deterministic in `seed`). `difficulties`, taken in turn, and `kinds` narrow them
        where the environment has such choices (None: its own mixture); one without them refuses them."""
        raise NotImplementedError

    def reset(self, task: Task) -> Prompt:
        raise NotImplementedError

    def step(self, reply: Reply) -> list[dict[str, Any]] | None:
        self.record(reply)
        return None

    def verify(self) -> float:
        raise NotImplementedError

    def record(self, reply: Reply) -> None:
        self.replies.append({"content": reply.content or "", "reasoning": reply.reasoning_content or "",
                             "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments}
                                            for c in reply.tool_calls]})

    def state_dict(self) -> dict[str, Any]:
        """The episode as plain JSON values."""
        return {k: v.to_json() if isinstance(v, Task) else v for k, v in vars(self).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, Task.from_json(v) if k == "task" and v is not None else v)


ENVIRONMENTS: dict[str, type[Environment]] = {}


def task_difficulties(env: str, difficulties: Sequence[int] | None, kinds: Sequence[str] | None = None,
                      known_kinds: Sequence[str] = ()) -> tuple[int, ...]:
    """The difficulties a generator takes in turn (default 1, 2, 3), after refusing what it cannot honour: a
    difficulty outside 1–3, or kinds for an environment with none or outside `known_kinds`."""
    if kinds is not None and not known_kinds:
        raise ValueError(f"the {env} environment has no kinds of task to choose from")
    if kinds is not None and (not kinds or any(k not in known_kinds for k in kinds)):
        raise ValueError(f"{env} task kinds must be some of {', '.join(known_kinds)}, got {', '.join(kinds) or 'none'}")
    chosen = tuple(difficulties) if difficulties is not None else (1, 2, 3)
    if not chosen or any(d not in (1, 2, 3) for d in chosen):
        raise ValueError(f"{env} task difficulties must be some of 1, 2, 3, got {list(chosen)}")
    return chosen


def register(name: str):
    """Class decorator: make an Environment available to `k3 rl --env name`."""

    def add(cls: type[Environment]) -> type[Environment]:
        if name in ENVIRONMENTS and ENVIRONMENTS[name] is not cls:
            raise ValueError(f"two environments are registered as {name!r}")
        cls.name = name
        ENVIRONMENTS[name] = cls
        return cls

    return add


def get_environment(name: str) -> type[Environment]:
    """A registered environment, or `package.module:ClassName`. Raises ValueError."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--env {name}: cannot import it ({e})") from e
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ValueError(f"--env {name} is not an Environment subclass")
        if not cls.name:
            cls.name = name
        return cls
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(sorted(ENVIRONMENTS))} "
                         f"(or name one as package.module:ClassName)")
    return ENVIRONMENTS[name]


def load_tasks(path: str | Path, envs: dict[str, type[Environment]] | None = None) -> list[Task]:
    """Tasks from a JSONL file (one `Task.to_json` object per line). Each line's env must be one of `envs` when
    given. Errors name the line."""
    tasks, seen = [], set()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from e
            task = Task.from_json(obj, where)
            if envs is not None and task.env not in envs:
                raise ValueError(f"{where}: environment {task.env!r} is not one of this run's ({', '.join(envs)})")
            if task.id in seen:
                raise ValueError(f"{where}: task id {task.id!r} appears twice")
            seen.add(task.id)
            tasks.append(task)
    if not tasks:
        raise ValueError(f"{path} holds no tasks")
    return tasks


def write_tasks(path: str | Path, tasks: list[Task]) -> None:
    """Tasks to a JSONL file `load_tasks` reads, written atomically."""
    from k3.checkpoint import write_text_atomic

    write_text_atomic(path, "".join(json.dumps(t.to_json(), ensure_ascii=False) + "\n" for t in tasks))


def split_tasks(tasks: list[Task], heldout: int, seed: int) -> tuple[list[Task], list[Task]]:
    """(train, held-out): `heldout` tasks drawn with `seed`, the rest for training, order kept."""
    if heldout >= len(tasks):
        raise ValueError(f"{len(tasks)} tasks cannot spare {heldout} for evaluation")
    chosen = set(random.Random(seed).sample(range(len(tasks)), heldout))
    return ([t for i, t in enumerate(tasks) if i not in chosen], [t for i, t in enumerate(tasks) if i in chosen])


@dataclass
class TaskSampler:
    """Draws training tasks without replacement, reshuffling each pass; its state is two ints."""

    tasks: list[Task]
    seed: int
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._shuffle()

    def _shuffle(self) -> None:
        self._order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(self._order)

    def next(self) -> Task:
        if self.position >= len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._shuffle()
        task = self.tasks[self._order[self.position]]
        self.position += 1
        return task

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._shuffle()


def _import_all() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_all()
