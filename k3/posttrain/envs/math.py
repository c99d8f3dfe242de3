"""Exact-answer math: one question, one reply, reward 1 when the reply's final answer equals the task's.

The answer is the last number of the reply's response channel (the thinking is not read): an integer, a decimal or
a fraction, compared as exact rationals, so "0.5", "1/2" and "2/4" all answer 1/2. A reply without a number, or
one that ends inside its think channel, scores 0. Tasks are the arithmetic and word problems of the SFT data
generator (`k3.posttrain.sft_data`; `sums`, the easy tier, on request), so RL asks what SFT taught the format of.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from fractions import Fraction

from k3.posttrain.envs import Environment, Prompt, Task, register, task_difficulties

MATH_KINDS = ("arithmetic", "sums", "word")  # the SFT generators whose answer is one number

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?")


def parse_number(text: str) -> Fraction | None:
    """'1,234', '-3.5', '7/2' -> an exact Fraction; None if `text` is not one number."""
    text = text.strip().replace(",", "")
    try:
        if "/" in text:
            num, den = (part.strip() for part in text.split("/"))
            return Fraction(int(num), int(den)) if int(den) else None
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def final_number(text: str) -> Fraction | None:
    """The last number written in `text`."""
    found = _NUMBER.findall(text or "")
    return parse_number(found[-1]) if found else None


def answers_match(reply: str, answer: str) -> bool:
    want, got = parse_number(answer), final_number(reply)
    return want is not None and got is not None and got == want


@register("math")
class MathEnvironment(Environment):
    @classmethod
    def make_tasks(cls, n: int, seed: int, difficulties: Sequence[int] | None = None,
                   kinds: Sequence[str] | None = None) -> list[Task]:
        """The SFT generators' problems of `kinds` (default arithmetic and word problems; `sums` is the easy tier)
        taken in turn, each kind at `difficulties` in turn, from a stream of their own
        (`random.Random(f"math:{seed}:{i}")`), so they are not the SFT set's problems."""
        from k3.posttrain import sft_data

        chosen = task_difficulties(cls.name, difficulties, kinds, MATH_KINDS)
        kinds = tuple(kinds) if kinds is not None else ("arithmetic", "word")
        tasks = []
        for i in range(n):
            kind, difficulty = kinds[i % len(kinds)], chosen[(i // len(kinds)) % len(chosen)]
            problem = sft_data.GENERATORS[kind](random.Random(f"math:{seed}:{i}"), difficulty)
            tasks.append(Task(f"math-{seed}-{i}", cls.name, {"question": problem.question, "answer": problem.answer,
                                                           "kind": kind, "difficulty": difficulty}))
        return tasks

    def reset(self, task: Task) -> Prompt:
        self.task, self.replies = task, []
        if not isinstance(task.data.get("question"), str) or parse_number(str(task.data.get("answer", ""))) is None:
            raise ValueError(f"math task {task.id}: needs a string question and a numeric answer")
        return Prompt([{"role": "user", "content": task.data["question"]}])

    def verify(self) -> float:
        if not self.replies:
            return 0.0
        return float(answers_match(self.replies[-1]["content"], str(self.task.data["answer"])))
