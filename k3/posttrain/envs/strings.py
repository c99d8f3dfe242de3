"""String and list tasks: one question, one reply, reward 1 when the reply's final answer is the task's.

The tasks are the string problems of the SFT data generator (`k3.posttrain.sft_data.string_problem`: reverse a word,
count a letter, sort / sum / find the largest of a list, initials), from a stream of their own, so RL asks what SFT
taught the format of. The answer is what the response channel says after its last "answer is" (the SFT replies end
with "The answer is X."), without the closing period; without that phrase, the whole response. It matches when the
two are equal after collapsing whitespace, or when both are numbers of equal value (`k3.posttrain.envs.math`).
The thinking is not read; a reply that ends inside its think channel scores 0.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from k3.posttrain.envs import Environment, Prompt, Task, register, task_difficulties
from k3.posttrain.envs.math import parse_number

_ANSWER_IS = re.compile(r"answer is\s*", re.IGNORECASE)


def final_answer(text: str) -> str:
    """The text after the last "answer is" (or all of it), whitespace collapsed, the closing period dropped."""
    found = list(_ANSWER_IS.finditer(text or ""))
    tail = (text or "")[found[-1].end():] if found else (text or "")
    return " ".join(tail.split()).rstrip(".").strip()


def answers_equal(reply: str, answer: str) -> bool:
    got, want = final_answer(reply), " ".join(answer.split())
    if got == want:
        return True
    a, b = parse_number(got), parse_number(want)
    return a is not None and b is not None and a == b


@register("strings")
class StringsEnvironment(Environment):
    @classmethod
    def make_tasks(cls, n: int, seed: int, difficulties: Sequence[int] | None = None,
                   kinds: Sequence[str] | None = None) -> list[Task]:
        from k3.posttrain.sft_data import string_problem

        chosen = task_difficulties(cls.name, difficulties, kinds)
        tasks = []
        for i in range(n):
            problem = string_problem(random.Random(f"strings:{seed}:{i}"), chosen[i % len(chosen)])
            tasks.append(Task(f"strings-{seed}-{i}", cls.name, {"question": problem.question, "answer": problem.answer}))
        return tasks

    def reset(self, task: Task) -> Prompt:
        self.task, self.replies = task, []
        if not (isinstance(task.data.get("question"), str) and isinstance(task.data.get("answer"), str)
                and task.data["answer"].strip()):
            raise ValueError(f"strings task {task.id}: needs a string question and a non-empty string answer")
        return Prompt([{"role": "user", "content": task.data["question"]}])

    def verify(self) -> float:
        if not self.replies:
            return 0.0
        return float(answers_equal(self.replies[-1]["content"], self.task.data["answer"]))
