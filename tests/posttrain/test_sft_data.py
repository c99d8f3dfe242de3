"""The generated SFT set: every answer is exact (recomputed independently), every step's arithmetic is right,
reasoning grows with the effort level, the set is a pure function of its seed, and every conversation renders."""

from __future__ import annotations

import ast
import json
import operator
import random
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from k3.chat.template import ChatTemplate
from k3.posttrain import sft_data
from k3.posttrain.conversations import read_conversations, render_conversation
from k3.posttrain.envs.tools import calculate

REPO = Path(__file__).resolve().parents[2]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> Fraction:
    """An independent evaluator: Python's own parse of the expression, exact."""
    def ev(node):
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp):
            return -ev(node.operand)
        return Fraction(node.value)
    return ev(ast.parse(expression, mode="eval").body)


def expression_of(question: str) -> str:
    for prefix in ("What is ", "Compute ", "Calculate ", "Evaluate "):
        question = question.removeprefix(prefix)
    return question.rstrip("?.")


def check_steps(problem):
    """Every `a op b = v` in the steps is right."""
    for _, work in problem.steps:
        if " = " in work and any(op in work for op in " + - * / ".split()):
            lhs, value = work.split(" = ")
            assert evaluate(lhs) == Fraction(value), work


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_arithmetic_answers_and_steps_are_exact(difficulty):
    for i in range(200):
        problem = sft_data.arithmetic_problem(random.Random(i), difficulty)
        assert evaluate(expression_of(problem.question)) == Fraction(problem.answer), problem.question
        assert len(problem.steps) == difficulty
        check_steps(problem)
        assert problem.steps[-1][1].endswith(f"= {problem.answer}")
        if " = " in problem.check:  # the max-effort check is a true equation too (not for a product with 0)
            lhs, value = problem.check.removeprefix("Check: ").split(",")[0].split(" = ")
            assert evaluate(lhs) == Fraction(value)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_word_problems_chain_their_steps_to_the_answer(difficulty):
    for i in range(200):
        problem = sft_data.word_problem(random.Random(i), difficulty)
        check_steps(problem)
        assert problem.steps[-1][1].split(" = ")[-1] == problem.answer, problem
        assert len(problem.steps) >= difficulty
        assert problem.question.endswith("?")
        # every number a step uses comes from the question or an earlier step
        known = set(map(int, re.findall(r"\d+", problem.question)))
        for _, work in problem.steps:
            lhs, value = work.split(" = ")
            assert all(int(x) in known for x in lhs.split() if x.isdigit()), (problem.question, work)
            known.add(int(value))


def test_string_problems_are_right():
    seen = set()
    for i in range(300):
        problem = sft_data.string_problem(random.Random(i), 1 + i % 3)
        q = problem.question
        quoted = q.split("'")[1::2]
        if q.startswith("Reverse"):
            want = quoted[0][::-1]
        elif q.startswith("How many times"):
            want = str(quoted[1].count(quoted[0]))
        elif q.startswith("Sort"):
            numbers = [int(x) for x in q.split(": ")[1].rstrip(".").split(", ")]
            want = ", ".join(map(str, sorted(numbers)))
        elif q.startswith("What is the sum"):
            numbers = [int(x) for x in q.removeprefix("What is the sum of ").rstrip("?").split(", ")]
            want = str(sum(numbers))
        elif q.startswith("Which is the largest"):
            numbers = [int(x) for x in q.removeprefix("Which is the largest of ").rstrip("?").split(", ")]
            want = str(max(numbers))
        else:
            want = "".join(w[0] for w in quoted[0].split()).upper()
        seen.add(q.split()[0])
        assert problem.answer == want, q
    assert len(seen) >= 5  # every kind of task came up


def test_tool_problems_answer_through_the_tools():
    for i in range(200):
        problem = sft_data.tool_problem(random.Random(i), 1 + i % 3)
        keys = [args["key"] for name, args in problem.turns[0].calls if name == "lookup"]
        assert keys and all(k in problem.table for k in keys) and f"'{keys[0]}'" in problem.question
        (name, args), = problem.turns[1].calls
        assert name == "calculator"
        assert calculate(args["expression"]) == problem.answer
        for key in keys:
            assert f"{problem.table[key]}" in args["expression"]


def test_reasoning_grows_with_effort_and_the_answer_ends_the_reply():
    conversations = sft_data.make_sft_dataset(90, seed=3)
    by_id = {}
    for c in conversations:
        by_id.setdefault(c.id, {})[c.reasoning_effort] = c
    assert len(by_id) == 90 and all(set(v) == {"low", "high", "max"} for v in by_id.values())
    for versions in by_id.values():
        think = {e: sum(len(m.get("reasoning_content") or "") for m in c.messages) for e, c in versions.items()}
        assert think["low"] < think["high"] < think["max"], versions["low"].id
        # the same questions and answers at every effort; the reply ends with the answer
        asked = {e: [m["content"] for m in c.messages if m["role"] != "assistant"] for e, c in versions.items()}
        assert asked["low"] == asked["high"] == asked["max"]
        final = versions["low"].messages[-1]
        assert final["role"] == "assistant" and final["content"].startswith("The answer is ")
    kinds = {c.id.split("-")[0] for c in conversations}
    assert kinds == set(sft_data.KINDS)


def test_the_set_is_a_function_of_its_seed_and_every_conversation_renders(tmp_path, tokenizer):
    a = [c.to_json() for c in sft_data.make_sft_dataset(40, seed=1)]
    assert a == [c.to_json() for c in sft_data.make_sft_dataset(40, seed=1)]
    assert a[:60] == [c.to_json() for c in sft_data.make_sft_dataset(20, seed=1)]  # a longer set extends a shorter
    assert a != [c.to_json() for c in sft_data.make_sft_dataset(40, seed=2)]
    template = ChatTemplate(tokenizer)
    for record in a:
        rendered = render_conversation(template, sft_data.Conversation(**{
            "messages": record["messages"], "tools": record.get("tools"),
            "reasoning_effort": record["reasoning_effort"], "id": record["id"]}))
        assert sum(rendered.loss_mask) > 0
        assert len(rendered.turns) == sum(m["role"] == "assistant" for m in record["messages"])
    with pytest.raises(ValueError, match="efforts must be"):
        sft_data.make_sft_dataset(2, efforts=["medium"])
    with pytest.raises(ValueError, match="difficulty"):
        sft_data.arithmetic_problem(random.Random(0), 4)


def test_math_tasks_for_rl_are_exact_and_apart_from_the_sft_set():
    from k3.posttrain.envs import get_environment

    tasks = get_environment("math").make_tasks(60, seed=0)
    assert len(tasks) == 60 and tasks == get_environment("math").make_tasks(60, seed=0)
    for t in tasks[::2]:
        assert t.data["kind"] == "arithmetic"
        assert evaluate(expression_of(t.data["question"])) == Fraction(t.data["answer"])
    sft_questions = {m["content"] for c in sft_data.make_sft_dataset(200, seed=0) for m in c.messages
                     if m["role"] == "user"}
    assert len({t.data["question"] for t in tasks} & sft_questions) < 5  # another stream: overlaps only by chance


def test_cli_writes_the_same_file_for_the_same_seed(tmp_path):
    outs = []
    for name in ("a.jsonl", "b.jsonl"):
        result = subprocess.run([sys.executable, "-m", "k3.cli", "data", "make-sft", "--out", str(tmp_path / name),
                                 "--problems", "30", "--seed", "7", "--efforts", "low,max"],
                                cwd=REPO, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert "wrote 60 conversations (30 problems × 2 effort levels)" in result.stderr
        outs.append((tmp_path / name).read_bytes())
    assert outs[0] == outs[1]
    efforts = {json.loads(line)["reasoning_effort"] for line in outs[0].decode().splitlines()}
    assert efforts == {"low", "max"}
    assert len(read_conversations(tmp_path / "a.jsonl")) == 60


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_sums_are_the_easy_tier(difficulty):
    digits = {1: (1, 1), 2: (1, 2), 3: (2, 2)}[difficulty]
    for i in range(100):
        problem = sft_data.sum_problem(random.Random(i), difficulty)
        a, b = (int(x) for x in problem.steps[0][1].split(" = ")[0].split(" + "))
        assert sorted((len(str(a)), len(str(b)))) == list(digits)
        assert problem.answer == str(a + b) and f"{a} + {b}" in problem.question
    with pytest.raises(ValueError, match="difficulty"):
        sft_data.sum_problem(random.Random(0), 0)


def test_dataset_of_chosen_kinds_and_difficulties():
    conversations = sft_data.make_sft_dataset(60, seed=5, kinds=["sums", "string"], difficulties=[1])
    assert {c.id.split("-")[0] for c in conversations} == {"sums", "string"}
    sums = [c for c in conversations if c.id.startswith("sums")]
    # difficulty 1: two one-digit numbers
    assert all(len(c.messages[-1]["content"].split()[-1].rstrip(".")) <= 2 for c in sums)
    for bad in ({"kinds": ["poems"]}, {"kinds": []}, {"difficulties": [0]}, {"difficulties": []}):
        with pytest.raises(ValueError):
            sft_data.make_sft_dataset(2, **bad)
