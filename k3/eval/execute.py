"""Running generated programs (HumanEval's checks) where they cannot hurt the host: one fresh `k3.sandbox` sandbox
per program (no network, own filesystem, memory/pids/CPU limits, the whole pid namespace killed at the timeout;
docs/sandbox.md). Where sandboxes cannot run (no root, no bubblewrap or overlayfs: `k3 sandbox probe` says why),
`SubprocessExecutor` runs the program in a plain child process with rlimits behind the same interface: it
bounds CPU time, memory, file size and open files, but the program still sees the host's files and network
(docs/evaluation.md).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Protocol

PROGRAM = "program.py"


@dataclass
class Execution:
    passed: bool  # exit status 0 within the time limit
    exit_code: int
    output: str  # the last 2,000 characters of stdout + stderr
    duration: float
    error: str | None = None  # "timeout" when the limit killed it


class Executor(Protocol):
    kind: str

    def run(self, program: str, timeout: float) -> Execution: ...

    def close(self) -> None: ...


def _tail(stdout: str, stderr: str) -> str:
    return (stdout + stderr)[-2000:]


class SandboxExecutor:
    """Each program in a new sandbox of the base template (`python3` and the standard library), killed after."""

    kind = "sandbox"

    def __init__(self, state_dir: str | None = None, memory_mb: int = 512, pids: int = 64):
        from k3.sandbox import Manager, SandboxConfig

        config = SandboxConfig(memory_mb=memory_mb, pids=pids, cpus=1.0)
        if state_dir is not None:
            config.state_dir = state_dir
        self.manager = Manager(config)
        self.manager.ensure_template("base")

    def run(self, program: str, timeout: float) -> Execution:
        sbx = self.manager.create(timeout=timeout + 60)
        try:
            self.manager.write_file(sbx.id, f"/home/user/{PROGRAM}", program)
            r = self.manager.exec(sbx.id, ["python3", PROGRAM], timeout=timeout)
        finally:
            self.manager.kill(sbx.id)
        return Execution(r.exit_code == 0 and r.error is None, r.exit_code, _tail(r.stdout, r.stderr), r.duration,
                         r.error)

    def close(self) -> None:
        self.manager.close()


# rlimits before exec: CPU seconds, address space (KiB), file size (512-byte blocks), open files; no core files
LIMITS = 'ulimit -t "$1"; ulimit -v "$2"; ulimit -f 32768; ulimit -n 64; ulimit -c 0; shift 2; exec "$@"'


class SubprocessExecutor:
    """The fallback: `python3 -I program.py` in a fresh temporary folder, in its own session (killed as a group
    at the timeout), with CPU, memory, file-size and open-file limits and an empty environment."""

    kind = "subprocess"

    def __init__(self, memory_mb: int = 1024):
        self.memory_kb = memory_mb * 1024

    def run(self, program: str, timeout: float) -> Execution:
        folder = tempfile.mkdtemp(prefix="k3-eval-")
        try:
            with open(os.path.join(folder, PROGRAM), "w") as f:
                f.write(program)
            argv = ["/bin/sh", "-c", LIMITS, "k3-exec", str(int(timeout) + 1), str(self.memory_kb),
                    sys.executable, "-I", PROGRAM]
            start = time.monotonic()
            proc = subprocess.Popen(argv, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
            error = None
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                error = "timeout"
            code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
            return Execution(code == 0 and error is None, code,
                             _tail(out.decode(errors="replace"), err.decode(errors="replace")),
                             time.monotonic() - start, error)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        pass


def default_executor(kind: str = "auto", state_dir: str | None = None) -> Executor:
    """`sandbox` (an error where it cannot run), `subprocess`, or `auto`: the sandbox where its manager starts
    (bubblewrap, overlayfs and, for overlay mounts, root: `k3 sandbox probe`), else the subprocess fallback with a
    warning naming why."""
    if kind == "subprocess":
        return SubprocessExecutor()
    if kind not in ("auto", "sandbox"):
        raise ValueError(f"executor must be auto, sandbox or subprocess, got {kind!r}")
    try:
        return SandboxExecutor(state_dir)
    except (RuntimeError, OSError) as e:
        if kind == "sandbox":
            raise ValueError(f"sandboxes cannot run here: {e}") from None
        print(f"k3 eval: warning: running programs in a resource-limited subprocess, not a sandbox ({e}): they "
              "can read the host's files and reach its network", file=sys.stderr)
        return SubprocessExecutor()
