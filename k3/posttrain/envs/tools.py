"""Multi-turn tool use: the policy calls deterministic tools through the chat template's tool calls, reads their
results, and answers; reward 1 when the final answer equals the task's.

Two tools, declared to the policy in the prompt's `tool-declare` option: `lookup(key)`, which reads the task's own
table of values, and `calculator(expression)`, which evaluates arithmetic (+ − × ÷, parentheses, integers and
decimals; nothing else is evaluated). An episode is: prompt → reply with tool calls → tool results → … → a reply
without tool calls, whose last number is the answer (`k3.posttrain.envs.math.answers_match`). At most `max_turns`
replies; an episode that has not answered by then scores 0. Agentic: every generated token counts against the
budget. Tasks are the SFT data's price questions, so a correct episode looks prices up and computes with them.
"""

from __future__ import annotations

import ast
import json
import operator
import random
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from k3.chat.template import Reply
from k3.posttrain.envs import Environment, Prompt, Task, register, task_difficulties
from k3.posttrain.envs.math import answers_match

TOOLS = [
    {"type": "function", "function": {
        "name": "lookup", "description": "Look up the value stored under a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """Exact arithmetic on a string: '3*(4+1)/2' -> '7.5'. Raises ValueError for anything else."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("only numbers, + - * / and parentheses")

    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        value = ev(ast.parse(expression.replace("×", "*").replace("÷", "/"), mode="eval"))
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(str(e)) from e
    return str(value.numerator) if value.denominator == 1 else format(float(value), "g")


def call_tool(name: str, arguments: str, table: dict[str, Any]) -> str:
    """One tool call's result text (errors are results too: the policy reads them)."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    if not isinstance(args, dict):
        return "error: arguments must be an object"
    if name == "lookup":
        key = str(args.get("key", "")).strip().lower()
        return str(table[key]) if key in table else f"error: no value for {key!r}"
    if name == "calculator":
        try:
            return calculate(str(args.get("expression", "")))
        except ValueError as e:
            return f"error: {e}"
    return f"error: unknown tool {name!r}"


@register("tools")
class ToolEnvironment(Environment):
    agentic = True
    max_turns = 4

    @classmethod
    def make_tasks(cls, n: int, seed: int, difficulties: Sequence[int] | None = None,
                   kinds: Sequence[str] | None = None) -> list[Task]:
        """The SFT data's price questions (`k3.posttrain.sft_data.tool_problem`), `difficulties` (default 1, 2, 3)
        in turn, from a stream of their own."""
        from k3.posttrain import sft_data

        chosen = task_difficulties(cls.name, difficulties, kinds)
        tasks = []
        for i in range(n):
            problem = sft_data.tool_problem(random.Random(f"tools:{seed}:{i}"), chosen[i % len(chosen)])
            tasks.append(Task(f"tools-{seed}-{i}", cls.name,
                              {"question": problem.question, "table": problem.table, "answer": problem.answer}))
        return tasks

    def reset(self, task: Task) -> Prompt:
        self.task, self.replies = task, []
        if not isinstance(task.data.get("table"), dict) or not isinstance(task.data.get("question"), str):
            raise ValueError(f"tools task {task.id}: needs a question and a table")
        return Prompt([{"role": "user", "content": task.data["question"]}], tools=TOOLS)

    def step(self, reply: Reply) -> list[dict[str, Any]] | None:
        self.record(reply)
        if not reply.tool_calls:
            return None
        return [{"role": "tool", "tool_call_id": call.id,
                 "content": call_tool(call.name, call.arguments, self.task.data["table"])}
                for call in reply.tool_calls]

    def verify(self) -> float:
        if not self.replies or self.replies[-1]["tool_calls"]:
            return 0.0
        return float(answers_match(self.replies[-1]["content"], str(self.task.data["answer"])))
