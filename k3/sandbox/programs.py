"""Running one generated Python program under resource limits: in a fresh sandbox of this package where sandboxes
run (`SandboxRunner`), else in a plain child process (`SubprocessRunner`), behind one interface
(`ProgramRunner.run(program, limits, stdin) -> ExecResult`). HumanEval's checks (`k3.eval.execute`) and the RL code
environment (`k3.posttrain.envs.code`) both run their programs here; `run_asserts` on top counts how many of a
candidate's asserts pass, in one run (docs/sandbox.md, "Running generated programs").

Both runners start the program the same way: `/bin/sh` lowers its own rlimits (CPU seconds, address space, file
size, open files, no core files) and execs a fresh `python -I` (no user site, no PYTHON* variables, the script's
folder not on `sys.path`) on the program, in an empty working folder, with an empty environment, in its own
session; past the wall-clock limit, or past the output limit, the whole process group is killed. The sandbox adds
its walls: no network, its own filesystem over the base template, a memory cgroup, a pids limit and a CPU quota,
and its whole pid namespace dies with the program. The subprocess fallback is process isolation only: the program
can read the host's files and reach its network.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Protocol

from k3.sandbox.manager import Command, ExecResult, Manager, SandboxConfig

PROGRAM = "program.py"
SANDBOX_PROGRAM = f"/tmp/{PROGRAM}"  # outside the working folder (/home/user), which starts empty
# the fallback's whole environment; a sandbox sets PATH, HOME, USER, LOGNAME and LANG only
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
# rlimits, then exec: CPU seconds, address space (KiB), file size (512-byte blocks), open files; no core files.
# `&&`: a limit that cannot be set fails the run instead of leaving the program unlimited
LIMITS = ('ulimit -t "$1" && ulimit -v "$2" && ulimit -f "$3" && ulimit -n "$4" && ulimit -c 0 && shift 4 && '
          'exec "$@"')


@dataclass(frozen=True)
class Limits:
    """What one program may use. Both runners apply every field the same way."""

    wall_seconds: float = 10.0  # then it and everything it started are killed: error "timeout"
    cpu_seconds: int = 5  # RLIMIT_CPU, soft = hard: the kernel kills it (SIGKILL, exit code 137)
    memory_mb: int = 1024  # RLIMIT_AS (allocations fail: MemoryError); in a sandbox also its cgroup's memory
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE, rounded up to 512-byte blocks: a longer write fails (EFBIG)
    open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 16 << 20  # stdout + stderr; past it the program is killed: error "output limit"

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")


def launch_argv(python: str, program: str, limits: Limits) -> list[str]:
    """The command line both runners start: `/bin/sh` sets the limits and execs `python -I program`."""
    return ["/bin/sh", "-c", LIMITS, "k3-program", str(limits.cpu_seconds), str(limits.memory_mb << 10),
            str(-(-limits.file_bytes // 512)), str(limits.open_files), python, "-I", program]


class ProgramRunner(Protocol):
    kind: str  # "sandbox" or "subprocess"

    def run(self, program: str, limits: Limits = Limits(), stdin: str | None = None) -> ExecResult:
        """Run the Python source `program` to its end; `stdin`, if given, is its standard input (a pipe: read
        once, it cannot be read again). stdout and stderr are decoded as UTF-8, bad bytes replaced; the exit code
        is 128 + signal when a signal ended it; `error` is "timeout" or "output limit" when the runner killed it."""
        ...

    def close(self) -> None: ...


def _feed(pipe: IO[bytes], data: bytes) -> None:
    # the program may end, or be killed, before reading all of it
    with contextlib.suppress(OSError, ValueError), pipe:
        pipe.write(data)


def _finish(command: Command, stdin: str | None) -> ExecResult:
    """Feed stdin (from a thread, so a program that writes before reading cannot deadlock) and collect the output
    until the command ends; `Command.stream` enforces the deadline and the output limit."""
    feeder = None
    if stdin is not None:
        # the feeder owns the pipe and closes it; the command must not close it under a blocked write
        pipe, command.popen.stdin = command.popen.stdin, None
        feeder = threading.Thread(target=_feed, args=(pipe, stdin.encode()), daemon=True)
        feeder.start()
    out = {"stdout": bytearray(), "stderr": bytearray()}
    for name, data in command.stream():
        out[name] += data
    if feeder is not None:
        feeder.join()
    return ExecResult(out["stdout"].decode(errors="replace"), out["stderr"].decode(errors="replace"),
                      command.exit_code, command.duration, command.error)


class SubprocessRunner:
    """The fallback: the host's Python (this interpreter) in a fresh temporary folder (see the module docstring)."""

    kind = "subprocess"

    def run(self, program: str, limits: Limits = Limits(), stdin: str | None = None) -> ExecResult:
        with tempfile.TemporaryDirectory(prefix="k3-program-", ignore_cleanup_errors=True) as folder:
            path, cwd = Path(folder) / PROGRAM, Path(folder) / "work"
            path.write_text(program)
            cwd.mkdir()
            argv = launch_argv(sys.executable, str(path), limits)
            popen = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                     env=ENV)
            # the manager's own command reader: deadline, output limit, process-group kill, exit code 128 + signal
            command = Command(sandbox="", popen=popen, timeout=limits.wall_seconds, max_output=limits.output_bytes,
                              argv=argv, envs=ENV, cwd=str(cwd), tag=None)
            return _finish(command, stdin)

    def close(self) -> None:
        pass


class SandboxRunner:
    """Each program in a new sandbox of the base template (the host's `python3` and its standard library), killed
    after. `state_dir` is the manager's state folder (default: `k3.sandbox.manager.default_state_dir()`); or pass
    a running `manager`, which `close` then leaves running. Raises RuntimeError where sandboxes cannot run."""

    kind = "sandbox"

    def __init__(self, state_dir: str | Path | None = None, *, manager: Manager | None = None, pids: int = 64,
                 cpus: float = 1.0):
        if manager is not None and state_dir is not None:
            raise ValueError("give SandboxRunner a state_dir or a manager, not both")
        self.owns_manager = manager is None
        if manager is None:
            manager = Manager(SandboxConfig() if state_dir is None else SandboxConfig(state_dir=Path(state_dir)))
        self.manager, self.pids, self.cpus = manager, pids, cpus
        self.manager.ensure_template("base")

    def run(self, program: str, limits: Limits = Limits(), stdin: str | None = None) -> ExecResult:
        sbx = self.manager.create(timeout=limits.wall_seconds + 60, memory_mb=limits.memory_mb, pids=self.pids,
                                  cpus=self.cpus)
        try:
            self.manager.write_file(sbx.id, SANDBOX_PROGRAM, program)
            command = self.manager.start(sbx.id, launch_argv("python3", SANDBOX_PROGRAM, limits),
                                         timeout=limits.wall_seconds, stdin=stdin is not None)
            command.max_output = limits.output_bytes  # this run's limit, not the manager's default
            return _finish(command, stdin)
        finally:
            self.manager.kill(sbx.id)

    def close(self) -> None:
        if self.owns_manager:
            self.manager.close()


def program_runner(kind: str = "auto", state_dir: str | Path | None = None) -> ProgramRunner:
    """`sandbox` (a ValueError where it cannot run), `subprocess`, or `auto`: the sandbox where its manager starts
    (bubblewrap, overlayfs and, for overlay mounts, root: `k3 sandbox probe`), else the subprocess fallback with a
    warning naming why."""
    if kind == "subprocess":
        return SubprocessRunner()
    if kind not in ("auto", "sandbox"):
        raise ValueError(f"programs run in auto, sandbox or subprocess, got {kind!r}")
    try:
        return SandboxRunner(state_dir)
    except (RuntimeError, OSError) as e:
        if kind == "sandbox":
            raise ValueError(f"sandboxes cannot run here: {e}") from None
        print(f"k3: warning: running programs in a resource-limited subprocess, not a sandbox ({e}): they can read "
              "the host's files and reach its network", file=sys.stderr)
        return SubprocessRunner()


# ---- counting passing asserts ---------------------------------------------------------------------------------

# Reads {code, tests, token} from stdin (a pipe: gone once read), runs the code, then each test in a copy of its
# namespace, and prints the count last, on a line that starts with the token the candidate never saw in its output.
ASSERT_HARNESS = r"""
import json, sys
spec = json.loads(sys.stdin.read())
token, passed, error = spec["token"], 0, None
namespace = {"__name__": "candidate"}
try:
    exec(compile(spec["code"], "candidate.py", "exec"), namespace)
except BaseException as e:
    error = f"{type(e).__name__}: {e}"[:200]
if error is None:
    for test in spec["tests"]:
        try:
            exec(compile(test, "test.py", "exec"), dict(namespace))
            passed += 1
        except BaseException:
            pass
sys.stdout.flush()
print("\n" + token + json.dumps({"passed": passed, "error": error}), flush=True)
"""


@dataclass
class AssertReport:
    passed: int
    total: int
    # "timeout" / "output limit" (killed), "crash: exit code N" (no report line), or what the candidate's code
    # raised when it ran ("SyntaxError: …"; then no test ran)
    error: str | None = None

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def run_asserts(runner: ProgramRunner, code: str, tests: list[str], limits: Limits = Limits()) -> AssertReport:
    """Run `code`, then each test (Python statements, typically one `assert`) against its namespace, in one program
    on `runner`; count the tests that raise nothing. Only a report line starting with this run's random token
    counts, so what the candidate prints cannot pass for it. This bounds accidents and runaway code, not a
    determined adversary: the candidate runs in the harness's process."""
    token = "K3RESULT-" + secrets.token_hex(16) + ":"
    r = runner.run(ASSERT_HARNESS, limits, stdin=json.dumps({"code": code, "tests": tests, "token": token}))
    if r.error is not None:
        return AssertReport(0, len(tests), r.error)
    lines = [line for line in r.stdout.splitlines() if line.startswith(token)]
    if not lines:
        return AssertReport(0, len(tests), f"crash: exit code {r.exit_code}")
    result = json.loads(lines[-1][len(token):])
    return AssertReport(result["passed"], len(tests), result["error"])
