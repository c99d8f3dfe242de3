"""HumanEval's checks: a program passes when it exits 0 within its time limit. Where it runs is a
`k3.sandbox.programs` runner, shared with the RL code environment: one fresh `k3.sandbox` sandbox per program (no
network, own filesystem, memory/pids/CPU limits, the whole pid namespace killed at the timeout; docs/sandbox.md)
or, where sandboxes cannot run (no root, no bubblewrap or overlayfs: `k3 sandbox probe` says why), a plain child
process with the same rlimits, which still sees the host's files and network (docs/evaluation.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k3.sandbox.programs import Limits, ProgramRunner, program_runner

MEMORY_MB = 1024  # address space, and a sandbox's cgroup memory
FILE_BYTES = 16 << 20
OUTPUT_CHARS = 2000  # of stdout + stderr, kept for the report


@dataclass
class Execution:
    passed: bool  # exit status 0 within the time limit
    exit_code: int
    output: str  # the last 2,000 characters of stdout + stderr
    duration: float
    error: str | None = None  # "timeout" when the limit killed it


class Executor:
    """HumanEval programs on a program runner (`k3.sandbox.programs.SandboxRunner` or `SubprocessRunner`)."""

    def __init__(self, runner: ProgramRunner):
        self.runner = runner
        self.kind = runner.kind

    def run(self, program: str, timeout: float) -> Execution:
        """`timeout` seconds of wall clock, and as many CPU seconds plus one."""
        limits = Limits(wall_seconds=timeout, cpu_seconds=int(timeout) + 1, memory_mb=MEMORY_MB, file_bytes=FILE_BYTES)
        r = self.runner.run(program, limits)
        return Execution(r.exit_code == 0 and r.error is None, r.exit_code, (r.stdout + r.stderr)[-OUTPUT_CHARS:],
                         r.duration, r.error)

    def close(self) -> None:
        self.runner.close()


def default_executor(kind: str = "auto", state_dir: str | Path | None = None) -> Executor:
    """`sandbox` (a ValueError where it cannot run), `subprocess`, or `auto`: the sandbox where its manager starts,
    else the subprocess fallback with a warning naming why (`k3.sandbox.programs.program_runner`)."""
    return Executor(program_runner(kind, state_dir))
