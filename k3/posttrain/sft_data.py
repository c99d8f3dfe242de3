"""A generated SFT data set, so the whole post-training path runs offline (`k3 data make-sft`).

Five kinds of problems, each with an exact answer and worked reasoning, at difficulty 1–3:

    arithmetic_problem(rng, d)  expressions of d + 1 numbers (+ − * /, parentheses from d = 3), evaluated step by step
    sum_problem(rng, d)         the easy tier: a sum of two numbers, one digit each (d = 1), one and two digits (2),
                                two digits each (3); what a model of a few million parameters learns in minutes
    word_problem(rng, d)        shopping, travel, sharing, ages, savings: d steps of arithmetic in a short story
    string_problem(rng, d)      reverse a word, count a letter, sort / sum / find the largest of a list, initials
    tool_problem(rng, d)        prices from a key-value `lookup` tool, totals from a `calculator` tool
                                (the tools of `k3.posttrain.envs.tools`, so SFT teaches the calls RL later rewards)

Each returns a `Problem` (or `ToolProblem`): the question, the exact answer as text, the worked steps and a check.
Every problem becomes one conversation per effort level, `reasoning_effort` low, high or max (the template renders
it as the natural-language `thinking-effort` option, K3 report §4.1.2), with reasoning of three lengths:

    low   the steps' arithmetic only, on one line                       "3 * 4 = 12; 20 - 12 = 8."
    high  one line per step, saying what it computes                     "Cost of the pens: 3 * 4 = 12.\n…"
    max   a plan, the `high` lines, a check of the answer, a conclusion

The response is the same at every level and ends with the answer ("The answer is 8."), so the last number of a
reply is its answer (what `k3.posttrain.envs.math` reads). The three conversations of a problem share an `id`, so
they land on the same side of the held-out split. Everything is a function of the seed: problem i draws from
`random.Random(f"sft:{seed}:{i}")`, so the file is the same on every machine and a longer one extends a shorter one.
RL's environments (`k3.posttrain.envs`) draw their tasks from the same generators, from streams of their own.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any, NamedTuple

from k3.posttrain.conversations import Conversation

EFFORTS = ("low", "high", "max")
KINDS = ("arithmetic", "sums", "word", "string", "tools")
# shares of the data set by kind (of `KINDS`); a subset of the kinds keeps their relative shares
KIND_WEIGHTS = (0.25, 0.15, 0.25, 0.2, 0.15)
DIFFICULTIES = (1, 2, 3)
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a careful assistant. Answer exactly.",
                  "You solve problems step by step and give the final answer at the end.")
SYSTEM_FRACTION = 0.3  # conversations that start with a system message
FOLLOW_UP_FRACTION = 0.15  # conversations with a second user question (two assistant turns)

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kemal", "Lena", "Mia", "Noor",
         "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yara", "Zoe")
ITEMS = ("pen", "notebook", "apple", "ticket", "mug", "candle", "sticker", "lamp", "sock", "plate", "kite", "brush")
WORDS = ("river", "planet", "garden", "window", "pocket", "silver", "orange", "bridge", "castle", "forest", "rocket",
         "yellow", "pencil", "market", "summer", "winter", "button", "dragon", "mirror", "basket", "candle", "banana",
         "letter", "marble", "puzzle", "tunnel", "violin", "wizard", "coffee", "kitten", "lemon", "cloud", "stone",
         "table", "paper", "music", "ocean", "tiger", "honey", "apple", "robot", "train", "horse", "bread")
SHOP_ITEMS = ("apple", "kiwi", "fig", "plum", "pear", "lime", "date", "melon", "grape", "peach", "mango", "cherry")


class Problem(NamedTuple):
    """A problem with its exact answer. `steps`: (what the step computes, its arithmetic), in order; `check`: a
    sentence verifying the answer another way."""

    question: str
    answer: str
    steps: list[tuple[str, str]]
    check: str


class ToolCallStep(NamedTuple):
    """One assistant turn of a tool conversation: what it thinks at each effort, and the calls it makes
    (tool name, arguments object)."""

    thoughts: dict[str, str]
    calls: list[tuple[str, dict[str, Any]]]


class ToolProblem(NamedTuple):
    """A question answered with the tools: the lookup table, the exact answer, the tool-calling turns, the check."""

    question: str
    answer: str
    table: dict[str, int]
    turns: list[ToolCallStep]
    check: str


# ---- arithmetic ----------------------------------------------------------------------------------------------------

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_VERBS = {"+": "add", "-": "subtract", "*": "multiply", "/": "divide"}


class _Expr(NamedTuple):
    text: str
    value: int
    steps: list[tuple[str, str]]  # (operator, "a op b = v") in evaluation order
    precedence: int  # of the top operator; 3 for a number


def _expression(rng: random.Random, operands: int, difficulty: int) -> _Expr:
    """A random expression of `operands` numbers (a tree, parenthesised where the reading order needs it)."""
    if operands == 1:
        value = rng.randint(2, 20 if difficulty < 3 else 99)
        return _Expr(str(value), value, [], 3)
    op = rng.choice("+-*" if difficulty < 3 else "+-*/")
    if op == "/":
        # exact division by a one-digit divisor of the left side (or another operator if it has none)
        left = _expression(rng, operands - 1, difficulty)
        divisors = [k for k in range(2, 10) if left.value and left.value % k == 0]
        if divisors:
            d = rng.choice(divisors)
            right = _Expr(str(d), d, [], 3)
        else:
            op, right = "+", _expression(rng, 1, difficulty)
    else:
        split = rng.randint(1, operands - 1)
        # products of small numbers only, so every step can be worked out by hand
        sub = min(difficulty, 2) if op == "*" else difficulty
        left, right = _expression(rng, split, sub), _expression(rng, operands - split, sub)
    prec = _PRECEDENCE[op]
    l_text = f"({left.text})" if left.precedence < prec else left.text
    # the right side in parentheses at equal precedence too, so the text reads in the order the steps compute
    r_text = f"({right.text})" if right.precedence <= prec else right.text
    value = {"+": left.value + right.value, "-": left.value - right.value, "*": left.value * right.value,
             "/": left.value // right.value if op == "/" else 0}[op]
    step = (op, f"{left.value} {op} {right.value} = {value}")
    return _Expr(f"{l_text} {op} {r_text}", value, left.steps + right.steps + [step], prec)


def _inverse_check(work: str) -> str:
    """`a op b = v` → the sentence checking it with the inverse operation."""
    lhs, v = work.split(" = ")
    a, op, b = lhs.split(" ")
    if op == "*" and b == "0":
        return f"Check: anything times 0 is 0, so {v} is right."
    inverse = {"+": f"{v} - {b} = {a}", "-": f"{v} + {b} = {a}", "*": f"{v} / {b} = {a}", "/": f"{v} * {b} = {a}"}
    return f"Check: {inverse[op]}, so the last step is right."


def arithmetic_problem(rng: random.Random, difficulty: int) -> Problem:
    """An expression of `difficulty` + 1 numbers (+ − *, and exact division with parentheses at difficulty 3); its
    integer value and the operations in the order they are evaluated."""
    _check_difficulty(difficulty)
    expr = _expression(rng, difficulty + 1, difficulty)
    question = rng.choice(("What is {}?", "Compute {}.", "Calculate {}.", "Evaluate {}.")).format(expr.text)
    steps = [(f"{'Then' if i else 'First'} {_VERBS[op]}", work) for i, (op, work) in enumerate(expr.steps)]
    return Problem(question, str(expr.value), steps, _inverse_check(expr.steps[-1][1]))


def sum_problem(rng: random.Random, difficulty: int) -> Problem:
    """The easy tier: a + b with one-digit numbers (difficulty 1), a one-digit and a two-digit number in either
    order (2), two two-digit numbers (3). One step, worked as `arithmetic_problem`'s are."""
    _check_difficulty(difficulty)
    a = rng.randint(1, 9) if difficulty < 3 else rng.randint(10, 99)
    b = rng.randint(1, 9) if difficulty == 1 else rng.randint(10, 99)
    if difficulty == 2 and rng.random() < 0.5:
        a, b = b, a
    work = f"{a} + {b} = {a + b}"
    question = rng.choice(("What is {}?", "Compute {}.", "Calculate {}.", "Evaluate {}.")).format(f"{a} + {b}")
    return Problem(question, str(a + b), [("First add", work)], _inverse_check(work))


# ---- word problems -------------------------------------------------------------------------------------------------

def word_problem(rng: random.Random, difficulty: int) -> Problem:
    """A short story needing `difficulty` steps of arithmetic; the answer is an integer."""
    _check_difficulty(difficulty)
    return rng.choice((_shopping, _travel, _sharing, _ages, _savings))(rng, difficulty)


def _shopping(rng: random.Random, d: int) -> Problem:
    name, item, other = rng.choice(NAMES), *rng.sample(ITEMS, 2)
    n, price = rng.randint(2, 9), rng.randint(2, 15)
    cost = n * price
    steps = [(f"Cost of the {item}s", f"{n} * {price} = {cost}")]
    question = f"{name} buys {n} {item}s at {price} dollars each."
    total, check = cost, f"Check: {cost} / {n} = {price}, the price of one."
    if d >= 2:
        m, price2 = rng.randint(2, 6), rng.randint(2, 12)
        total = cost + m * price2
        steps += [(f"Cost of the {other}s", f"{m} * {price2} = {m * price2}"),
                  ("Total cost", f"{cost} + {m * price2} = {total}")]
        question += f" {name} also buys {m} {other}s at {price2} dollars each."
        check = f"Check: {total} - {cost} = {m * price2}, the cost of the {other}s."
    if d == 3:
        bill = next(b for b in (20, 50, 100, 200, 500) if b > total)
        answer = bill - total
        steps.append((f"Change from {bill}", f"{bill} - {total} = {answer}"))
        question += f" {name} pays with a {bill}-dollar bill. How much change does {name} get?"
        return Problem(question, str(answer), steps, f"Check: {answer} + {total} = {bill}, the bill.")
    return Problem(question + f" How much does {name} pay in total?", str(total), steps, check)


def _travel(rng: random.Random, d: int) -> Problem:
    speed, hours = rng.randint(3, 12) * 10, rng.randint(2, 6)
    dist = speed * hours
    question = f"A train travels at {speed} km per hour for {hours} hours."
    steps = [("First part", f"{speed} * {hours} = {dist}")]
    answer = dist
    if d >= 2:
        speed2, hours2 = rng.randint(3, 12) * 10, rng.randint(1, 4)
        answer = dist + speed2 * hours2
        question += f" Then it travels at {speed2} km per hour for {hours2} more hours."
        steps += [("Second part", f"{speed2} * {hours2} = {speed2 * hours2}"),
                  ("Whole trip", f"{dist} + {speed2 * hours2} = {answer}")]
    if d == 3:
        back = rng.randint(1, answer // 10) * 5
        answer -= back
        question += f" Then it goes back {back} km the way it came."
        steps.append(("After going back", f"{answer + back} - {back} = {answer}"))
    question += " How far is it from where it started?" if d == 3 else " How far does it travel?"
    check = f"Check: {dist} / {hours} = {speed}, the first speed; the sum of the parts is {answer}."
    return Problem(question, str(answer), steps, check)


def _sharing(rng: random.Random, d: int) -> Problem:
    name, k = rng.choice(NAMES), rng.randint(2, 8)
    each = rng.randint(2, 12)
    total = k * each
    if d == 1:
        question = f"{name} shares {total} marbles equally among {k} friends. How many does each friend get?"
        return Problem(question, str(each), [("Marbles each", f"{total} / {k} = {each}")],
                       f"Check: {each} * {k} = {total}.")
    bought = rng.randint(1, total - 1)
    have = total - bought
    steps = [("Marbles in all", f"{have} + {bought} = {total}"), ("Marbles each", f"{total} / {k} = {each}")]
    question = f"{name} has {have} marbles and buys {bought} more, then shares them equally among {k} friends."
    answer = each
    if d == 3:
        lost = rng.randint(1, each - 1) if each > 1 else 0
        answer = each - lost
        question += f" Each friend then loses {lost}."
        steps.append(("Left for each", f"{each} - {lost} = {answer}"))
    question += " How many marbles does each friend have?"
    return Problem(question, str(answer), steps, f"Check: {each} * {k} = {total} = {have} + {bought}.")


def _ages(rng: random.Random, d: int) -> Problem:
    a, b = rng.sample(NAMES, 2)
    young, gap, later = rng.randint(3, 40), rng.randint(1, 30), rng.randint(2, 20)
    old = young + gap
    question = f"{b} is {young} years old. {a} is {gap} years older than {b}."
    steps = [(f"{a}'s age now", f"{young} + {gap} = {old}")]
    answer = old
    if d >= 2:
        answer = old + later
        question += f" How old will {a} be in {later} years?"
        steps.append((f"{a}'s age then", f"{old} + {later} = {answer}"))
    else:
        question += f" How old is {a}?"
    if d == 3:
        both = answer + young + later
        question = question[:-1] + f", and what will {a} and {b}'s ages add up to then?"
        steps += [(f"{b}'s age then", f"{young} + {later} = {young + later}"),
                  ("Sum of the ages", f"{answer} + {young + later} = {both}")]
        answer = both
    return Problem(question, str(answer), steps, f"Check: {old} - {young} = {gap}, the age gap.")


def _savings(rng: random.Random, d: int) -> Problem:
    name, per_week, weeks = rng.choice(NAMES), rng.randint(3, 25), rng.randint(2, 10)
    saved = per_week * weeks
    question = f"{name} saves {per_week} dollars a week for {weeks} weeks."
    steps = [("Saved", f"{per_week} * {weeks} = {saved}")]
    answer = saved
    if d >= 2:
        spent = rng.randint(1, saved - 1)
        answer = saved - spent
        question += f" Then {name} spends {spent} dollars."
        steps.append(("Left after spending", f"{saved} - {spent} = {answer}"))
    if d == 3:
        gift = rng.randint(5, 50)
        answer += gift
        question += f" A friend gives {name} {gift} dollars."
        steps.append(("After the gift", f"{answer - gift} + {gift} = {answer}"))
    question += f" How much money does {name} have now?" if d >= 2 else f" How much does {name} save?"
    return Problem(question, str(answer), steps, f"Check: {saved} / {weeks} = {per_week}, the weekly amount.")


# ---- strings and lists ---------------------------------------------------------------------------------------------

def string_problem(rng: random.Random, difficulty: int) -> Problem:
    """A string or list task; harder ones are longer (words of more letters, lists of more numbers)."""
    _check_difficulty(difficulty)
    kind = rng.choice(("reverse", "count", "sort", "sum", "largest", "initials"))
    size = 2 + 2 * difficulty
    if kind == "reverse":
        word = rng.choice([w for w in WORDS if len(w) <= size + 2])
        answer = word[::-1]
        return Problem(f"Reverse the word '{word}'.", answer,
                       [("Letters", " ".join(word)), ("Read from the end", " ".join(answer))],
                       f"Check: reversing '{answer}' gives '{word}' back.")
    if kind == "count":
        word = "".join(rng.choice([w for w in WORDS]) for _ in range(difficulty))
        letter = rng.choice(word)
        positions = [str(i + 1) for i, c in enumerate(word) if c == letter]
        return Problem(f"How many times does the letter '{letter}' appear in '{word}'?", str(len(positions)),
                       [("Letters", " ".join(word)), (f"Positions of '{letter}'", ", ".join(positions))],
                       f"Check: counting the positions gives {len(positions)}.")
    numbers = [rng.randint(1, 9 * 10 ** (difficulty - 1) + 10) for _ in range(size)]
    listed = ", ".join(map(str, numbers))
    if kind == "sort":
        answer = ", ".join(map(str, sorted(numbers)))
        remaining, steps = list(numbers), []
        while remaining:
            low = min(remaining)
            remaining.remove(low)
            steps.append(("Smallest left", str(low)))
        return Problem(f"Sort these numbers from smallest to largest: {listed}.", answer, steps,
                       f"Check: the sorted list has {len(numbers)} numbers, as the original does.")
    if kind == "sum":
        total, steps = numbers[0], []
        for x in numbers[1:]:
            steps.append(("Running total", f"{total} + {x} = {total + x}"))
            total += x
        return Problem(f"What is the sum of {listed}?", str(total), steps,
                       f"Check: adding from the end gives {sum(reversed(numbers))} too.")
    if kind == "largest":
        best, steps = numbers[0], [("Start with", str(numbers[0]))]
        for x in numbers[1:]:
            best = max(best, x)
            steps.append((f"Compare with {x}", f"largest so far {best}"))
        return Problem(f"Which is the largest of {listed}?", str(best), steps,
                       f"Check: no number in the list is above {best}.")
    words = rng.sample(WORDS, size)
    answer = "".join(w[0] for w in words).upper()
    return Problem(f"Write the first letter of each word of '{' '.join(words)}' in capitals.", answer,
                   [(f"First letter of {w}", w[0].upper()) for w in words],
                   f"Check: the answer has {len(words)} letters, one a word.")


# ---- tool use ------------------------------------------------------------------------------------------------------

def tool_problem(rng: random.Random, difficulty: int) -> ToolProblem:
    """A price question answered with the tools: look up 1–2 prices (`lookup`), then compute (`calculator`).
    Difficulty 1 asks one item's total (the question of RL's tools environment), 2 two items, 3 two items less a
    discount."""
    _check_difficulty(difficulty)
    table = {item: rng.randint(2, 30) for item in rng.sample(SHOP_ITEMS, 4)}
    items = rng.sample(sorted(table), 1 if difficulty == 1 else 2)
    counts = [rng.randint(2, 9) for _ in items]
    lookups = [("lookup", {"key": item}) for item in items]
    expression = " + ".join(f"{c}*{table[item]}" for c, item in zip(counts, items))
    answer = sum(c * table[item] for c, item in zip(counts, items))
    if difficulty == 1:
        question = f"How much do {counts[0]} of the item '{items[0]}' cost? Use the tools."
    else:
        question = (f"How much do {counts[0]} of the item '{items[0]}' and {counts[1]} of the item '{items[1]}' "
                    f"cost together? Use the tools.")
    if difficulty == 3:
        discount = rng.randint(1, max(1, answer // 4))
        question = question.replace(" Use the tools.", f" There is a discount of {discount} on the total. "
                                                       f"Use the tools.")
        expression += f" - {discount}"
        answer -= discount
    named = " and ".join(f"'{item}'" for item in items)
    first = ToolCallStep({"low": f"Look up {named}.",
                          "high": f"I need the price of {named}, so I look {'it' if len(items) == 1 else 'them'} "
                                  f"up first.",
                          "max": f"The question needs the price of {named}, which I do not know. I look "
                                 f"{'it' if len(items) == 1 else 'them'} up with the lookup tool, then compute the "
                                 f"total with the calculator."}, lookups)
    prices = ", ".join(f"'{item}' costs {table[item]}" for item in items)
    second = ToolCallStep({"low": f"{expression}.",
                           "high": f"The lookup says {prices}. Now I compute {expression}.",
                           "max": f"The lookup says {prices}. The total is {expression}; I use the calculator so "
                                  f"the arithmetic is exact."}, [("calculator", {"expression": expression})])
    return ToolProblem(question, str(answer), table, [first, second],
                       f"Check: the calculator computed {expression} = {answer} from the looked-up prices.")


# ---- conversations -------------------------------------------------------------------------------------------------

def reasoning(problem: Problem, effort: str) -> str:
    """The worked reasoning of `problem` at an effort level (module docstring)."""
    if effort == "low":
        return "; ".join(work for _, work in problem.steps) + "."
    lines = [f"{what}: {work}." for what, work in problem.steps]
    if effort == "high":
        return "\n".join(lines)
    if effort != "max":
        raise ValueError(f"effort must be one of {', '.join(EFFORTS)}, got {effort!r}")
    plan = f"Let me work through this in {len(lines)} step{'s' if len(lines) > 1 else ''} and then check the answer."
    return "\n".join([plan, *lines, problem.check, f"So the answer is {problem.answer}."])


def answer_text(answer: str) -> str:
    return f"The answer is {answer}."


def problem_turns(problem: Problem | ToolProblem, effort: str, call_prefix: str = "call") -> list[dict[str, Any]]:
    """The assistant's side of one problem after its question: one assistant message, or for a `ToolProblem` the
    tool-calling turns with the tools' results and then the answer."""
    if isinstance(problem, Problem):
        return [{"role": "assistant", "reasoning_content": reasoning(problem, effort),
                 "content": answer_text(problem.answer)}]
    from k3.posttrain.envs.tools import call_tool  # the RL environment's tools: one implementation of each

    messages: list[dict[str, Any]] = []
    for t, turn in enumerate(problem.turns):
        calls = [{"id": f"{call_prefix}_{t}_{j}", "type": "function",
                  "function": {"name": name, "arguments": json.dumps(args)}} for j, (name, args) in
                 enumerate(turn.calls)]
        messages.append({"role": "assistant", "reasoning_content": turn.thoughts[effort], "content": "",
                         "tool_calls": calls})
        for call in calls:
            result = call_tool(call["function"]["name"], call["function"]["arguments"], problem.table)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    final = {"low": f"{problem.answer}.", "high": f"The calculator gives {problem.answer}.",
             "max": f"The calculator gives {problem.answer}. {problem.check}"}[effort]
    messages.append({"role": "assistant", "reasoning_content": final, "content": answer_text(problem.answer)})
    return messages


GENERATORS = {"arithmetic": arithmetic_problem, "sums": sum_problem, "word": word_problem, "string": string_problem,
              "tools": tool_problem}


def make_sft_dataset(num_problems: int = 1200, seed: int = 0, efforts: Sequence[str] = EFFORTS,
                     kinds: Sequence[str] = KINDS, difficulties: Sequence[int] = DIFFICULTIES) -> list[Conversation]:
    """`num_problems` problems, each as one conversation per effort in `efforts` (module docstring): of the `kinds`
    in their `KIND_WEIGHTS` shares, each at a difficulty drawn uniformly from `difficulties` (a repeated value
    counts twice)."""
    if num_problems < 1:
        raise ValueError(f"num_problems must be positive, got {num_problems}")
    bad = [e for e in efforts if e not in EFFORTS]
    if bad or not efforts:
        raise ValueError(f"efforts must be some of {', '.join(EFFORTS)}, got {', '.join(efforts) or 'none'}")
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"kinds must be some of {', '.join(KINDS)}, got {', '.join(kinds) or 'none'}")
    if not difficulties or any(d not in DIFFICULTIES for d in difficulties):
        raise ValueError(f"difficulty must be 1, 2 or 3, got {', '.join(map(str, difficulties)) or 'none'}")
    weights = [KIND_WEIGHTS[KINDS.index(k)] for k in kinds]
    conversations = []
    for i in range(num_problems):
        rng = random.Random(f"sft:{seed}:{i}")
        kind = rng.choices(kinds, weights=weights)[0]
        difficulty = rng.choice(difficulties)
        problem = GENERATORS[kind](rng, difficulty)
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < SYSTEM_FRACTION else None
        follow_up = None
        if kind != "tools" and rng.random() < FOLLOW_UP_FRACTION:
            follow_up = GENERATORS[kind](rng, rng.choice(difficulties))
        again = rng.choice(("Next one: ", "Another question: ", "And this one? "))
        tools = None
        if kind == "tools":
            from k3.posttrain.envs.tools import TOOLS

            tools = TOOLS
        for effort in efforts:
            messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": problem.question})
            messages += problem_turns(problem, effort)
            if follow_up is not None:
                messages.append({"role": "user", "content": again + follow_up.question})
                messages += problem_turns(follow_up, effort)
            conversations.append(Conversation(messages, tools, effort, f"{kind}-{seed}-{i:05d}"))
    return conversations


def _check_difficulty(difficulty: int) -> None:
    if difficulty not in (1, 2, 3):
        raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty}")
