"""The program runners (k3.sandbox.programs), each test on both: the fresh isolated start, every limit, the
timeout that kills what the program started, stdin as a pipe, the output limit, and the assert harness whose
report the candidate's prints cannot forge. HumanEval and the RL code environment only check their own logic on
top (tests/eval/test_humaneval.py, tests/posttrain/test_envs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3.sandbox import probe
from k3.sandbox.programs import Limits, SandboxRunner, SubprocessRunner, program_runner, run_asserts


@pytest.fixture(params=["subprocess", "sandbox"])
def runner(request):
    if request.param == "subprocess":
        yield SubprocessRunner()
        return
    r = SandboxRunner(manager=request.getfixturevalue("manager"))
    yield r
    r.close()


def test_a_fresh_isolated_python(runner, monkeypatch):
    monkeypatch.setenv("K3_HOST_SECRET", "x")  # nothing of the caller's environment reaches the program
    r = runner.run("import json, os, sys\n"
                   "print(json.dumps({'cwd': os.listdir('.'), 'env': sorted(os.environ),\n"
                   "                  'isolated': sys.flags.isolated, 'stdin': sys.stdin.read()}))\n"
                   "print('to stderr', file=sys.stderr)\n"
                   "sys.exit(3)\n")
    assert (r.exit_code, r.error, r.stderr) == (3, None, "to stderr\n")
    seen = json.loads(r.stdout)
    assert seen["cwd"] == [] and seen["isolated"] == 1 and seen["stdin"] == ""
    assert "K3_HOST_SECRET" not in seen["env"]
    assert set(seen["env"]) <= {"PATH", "LANG", "PWD", "HOME", "USER", "LOGNAME"}  # the last three in a sandbox


def test_cpu_memory_file_and_open_file_limits(runner):
    # CPU seconds: killed (soft and hard limit are equal, so SIGKILL), long before the wall clock
    r = runner.run("while True:\n    pass\n", Limits(cpu_seconds=1, wall_seconds=30))
    assert (r.exit_code, r.error) == (137, None) and r.duration < 20
    # address space: the allocation fails inside, the program goes on
    r = runner.run("try:\n    bytearray(512 << 20)\nexcept MemoryError:\n    print('refused')\nbytearray(64 << 20)\n",
                   Limits(memory_mb=256))
    assert (r.exit_code, r.stdout) == (0, "refused\n"), r.stderr
    # file size: writes stop at the limit
    r = runner.run("import os\nwith open('f', 'wb') as f:\n    f.write(b'x' * 4096)\nprint(os.path.getsize('f'))\n"
                   "with open('f', 'ab') as f:\n    f.write(b'x')\n", Limits(file_bytes=4096))
    assert r.stdout == "4096\n" and r.exit_code == 1 and "File too large" in r.stderr
    r = runner.run("fs = [open('/dev/null') for _ in range(100)]\n", Limits(open_files=64))
    assert r.exit_code == 1 and "Too many open files" in r.stderr


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # an unreaped zombie is dead


def test_the_timeout_kills_everything_the_program_started(runner):
    r = runner.run("import subprocess, sys, time\n"
                   "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                   "print(child.pid, flush=True)\n"
                   "time.sleep(60)\n", Limits(wall_seconds=1.5))
    assert (r.exit_code, r.error) == (137, "timeout") and r.duration < 10
    if runner.kind == "subprocess":  # a sandbox's pids are its own namespace's, and the namespace is gone
        assert not _alive(int(r.stdout))


def test_stdin_is_a_pipe_read_once(runner):
    data = "x" * (1 << 20)  # more than a pipe holds: fed while the program runs
    r = runner.run("import sys\nfirst = sys.stdin.read()\nprint(len(first), repr(sys.stdin.read()))\n", stdin=data)
    assert r.stdout == f"{len(data)} ''\n"
    r = runner.run("print('never read it')\n", stdin=data)
    assert (r.exit_code, r.stdout) == (0, "never read it\n")


def test_output_limit(runner):
    r = runner.run("while True:\n    print('x' * 10000)\n", Limits(output_bytes=1 << 20))
    assert r.error == "output limit" and r.exit_code == 137
    assert len(r.stdout) <= (1 << 20) + (32 << 10)


def test_assert_counts_and_reports(runner):
    tests = ["assert f(2) == 4", "assert f(3) == 9", "assert f(0) == 1"]
    report = run_asserts(runner, "def f(x):\n    return x * x", tests)
    assert (report.passed, report.total, report.error, report.all_passed) == (2, 3, None, False)
    assert run_asserts(runner, "def f(x):\n    return x * x + (x == 0)", tests).all_passed
    assert run_asserts(runner, "def f(x) return", tests).error.startswith("SyntaxError")
    assert run_asserts(runner, "x = bytearray(1 << 34)", tests).error.startswith("MemoryError")
    assert run_asserts(runner, "import os\nos._exit(0)", tests).error == "crash: exit code 0"
    assert run_asserts(runner, "while True:\n    pass", tests, Limits(cpu_seconds=1)).error == "crash: exit code 137"
    assert run_asserts(runner, "import time\ntime.sleep(30)", tests, Limits(wall_seconds=1)).error == "timeout"
    # each test runs in its own copy of the candidate's namespace: what one binds, the next does not see
    assert run_asserts(runner, "x = 1", ["x = 2\nassert x == 2", "assert x == 1"]).all_passed


def test_the_candidate_cannot_forge_the_report(runner):
    tests = ["assert f(2) == 4", "assert f(3) == 9"]
    fake = "print('\\nK3RESULT-' + '0' * 32 + ':' + '{\"passed\": 2, \"error\": null}')\ndef f(x):\n    return 0"
    assert run_asserts(runner, fake, tests).passed == 0
    # the harness's input (with this run's token) was a pipe: the candidate cannot read it again
    report = run_asserts(runner, "import sys\nleft = sys.stdin.read()", ["assert left == ''"])
    assert report.all_passed


def test_limits_refuse_bad_values():
    for field in ("wall_seconds", "cpu_seconds", "memory_mb", "file_bytes", "open_files", "output_bytes"):
        with pytest.raises(ValueError, match=field):
            Limits(**{field: 0})


def test_program_runner_choices(monkeypatch, capsys, fresh_state):
    assert program_runner("subprocess").kind == "subprocess"
    with pytest.raises(ValueError, match="auto, sandbox or subprocess"):
        program_runner("docker")
    r = program_runner("auto", fresh_state)
    assert r.kind == "sandbox" and r.run("print(6 * 7)").stdout == "42\n"
    r.close()
    with monkeypatch.context() as m:  # undone before fresh_state's teardown starts a manager there
        m.setattr(probe, "bwrap", lambda: probe.Probe(False, "no bwrap (test)"))
        with pytest.raises(ValueError, match="sandboxes cannot run here: .*no bwrap"):
            program_runner("sandbox", fresh_state)
        assert program_runner("auto", fresh_state).kind == "subprocess"
    assert "not a sandbox" in capsys.readouterr().err
