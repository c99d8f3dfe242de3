"""A run folder and the process working in it: what every long-running command shares (`k3 train`; `k3 sft` and
`k3 rl` as they land), so that each stops cleanly, never shares its folder, and fails with one clear line.

- `StopSignals`: SIGINT and SIGTERM become a stop request that the command honours at its next safe point (a step
  boundary, inside `at_boundaries()`); outside such a stretch, or on a second signal, `Interrupted` is raised at
  once. Whatever a command is writing cleans up on the way out (checkpoints go through a `.tmp` folder), so the
  abrupt path never leaves half a file either. One more signal while that cleanup runs ends the process.
- `RunFolder`: creates the folder, holds an exclusive OS lock on `run.lock` for the life of the process (the kernel
  drops it on any exit, SIGKILL included, so a lock left by a dead process is stale and taken over; the file names
  its holder), and removes what a start added if the start fails before the run exists.
- `failure(exc)`: the exit code and the one line a user sees for an expected failure; anything else is a bug and
  keeps its traceback.

Exit codes: 0 done (or nothing left to do); 1 the system failed (disk full, permission denied, I/O error);
2 refused (bad arguments or data, a folder in use or holding something else, no run to resume);
3 the run cannot continue (e.g. it diverged; its last checkpoint is usable); 128 + N stopped by signal N
(130 SIGINT, 143 SIGTERM), with a checkpoint of the step reached unless it was stopped at once.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import math
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

EXIT_OK, EXIT_SYSTEM, EXIT_REFUSED, EXIT_RUN_FAILED = 0, 1, 2, 3
LOCK_FILE = "run.lock"


class RunError(RuntimeError):
    """The run cannot continue (e.g. repeated non-finite steps); its last checkpoint is usable. Exit code 3."""


class FolderInUse(ValueError):
    """Another live process holds the run folder's lock."""


class Interrupted(BaseException):
    """A signal that stops the process at once: a second one, or the first where no step boundary is near.
    A BaseException like KeyboardInterrupt, so that `except Exception` cleanup paths let it through."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """SIGINT/SIGTERM handlers for the `with` block (main thread only; elsewhere nothing is installed). Re-entrant:
    a command enters the same object early (before its heavy imports) and again around its work.

    Inside `at_boundaries()` the first signal only sets `signum`; the command polls it and stops at its next
    boundary. Otherwise a signal raises `Interrupted`. Once that is raised, a further signal ends the process as the
    signal itself would. A copy of a signal that arrives within `REPEAT_S` of the last one is ignored: a launcher
    (torchrun, srun) forwards to its workers the Ctrl-C the terminal already delivered to the whole process group,
    and that must not count as the user's second signal.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_S = 1.0

    def __init__(self, announce: bool = True):
        self.announce = announce
        self.signum: int | None = None
        self._raised = False
        self._last = -float("inf")
        self._deferring = False
        self._depth = 0
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def __enter__(self) -> StopSignals:
        if self._depth == 0 and threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            for s, handler in self._previous.items():
                signal.signal(s, handler)
            self._previous.clear()

    @contextlib.contextmanager
    def at_boundaries(self):
        """A stretch where the first signal waits for the command's next boundary instead of raising."""
        self._deferring = True
        try:
            yield self
        finally:
            self._deferring = False

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if now - self._last < self.REPEAT_S:
            return
        self._last = now
        if self._raised:
            # the process is already stopping at once and cleaning up: end it now, as the signal itself would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum is None:
            self.signum = signum
            if self._deferring:
                if self.announce and os.environ.get("RANK", "0") == "0":
                    # os.write: a print here could re-enter a stderr write the signal interrupted
                    os.write(2, f"\nk3: {signal.Signals(signum).name}: stopping after the current step with a "
                                f"checkpoint (send it again to stop at once)\n".encode())
                return
        self._raised = True
        raise Interrupted(signum)


class RunLock:
    """An exclusive `flock` on `<folder>/run.lock`, which records its holder (pid, host, command, start time).

    The kernel drops the lock when its process exits in any way, so a lock file with a record but no lock is stale:
    `acquire` takes it over and returns that record. A clean release empties the record. The file is never
    deleted while the folder lives: deleting it would let two processes lock two different files of one name.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.fd: int | None = None
        self.supported = True

    def acquire(self) -> dict | None:
        """Take the lock; returns the record a dead holder left (None if there was none). Raises FolderInUse."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_record(fd)
                os.close(fd)
                raise FolderInUse(self._in_use(holder)) from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise
                self.supported = False  # a filesystem without locks: work unlocked rather than not at all
            # the file may have been removed (a failed start cleaning up) between our open and our lock
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = _read_record(fd)
        argv = ["k3"] + sys.argv[1:] if Path(sys.argv[0]).name in ("k3", "cli.py") else sys.argv
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": shlex.join(argv),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self.fd = fd
        return stale

    def check_free(self) -> None:
        """Raise FolderInUse if another process holds the lock; writes nothing (refusals come before writes)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderInUse(self._in_use(_read_record(fd))) from None
        except OSError:
            pass  # no locks on this filesystem: `acquire` says so
        finally:
            os.close(fd)

    def _in_use(self, holder: dict | None) -> str:
        return (f"{self.folder} is in use by another k3 process ({describe_holder(holder)}); wait for it to finish "
                f"or stop it{_stop_hint(holder)}, or choose another folder")

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing the last descriptor drops the flock
        self.fd = None


def _read_record(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 1 << 16, 0)
        return json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return {"pid": None}


def describe_holder(record: dict | None) -> str:
    """`pid 123 on host, since …: k3 train …` from a lock record (None or partial: what is known)."""
    if not record or not record.get("pid"):
        return "its lock file names no process yet"
    text = f"pid {record['pid']}"
    if record.get("host") and record["host"] != socket.gethostname():
        text += f" on {record['host']}"
    if record.get("since"):
        text += f", since {record['since']}"
    if record.get("command"):
        text += f": {record['command']}"
    return text


def _stop_hint(record: dict | None) -> str:
    same_host = record and record.get("pid") and record.get("host", socket.gethostname()) == socket.gethostname()
    return f" (kill -INT {record['pid']} stops it with a checkpoint)" if same_host else ""


class RunFolder:
    """The folder a command works in, locked for the `with` block. Created if missing; if the block fails
    before `started()` (the run does not exist yet), what the block added is removed (the folder too, if it
    was created), so a refused or interrupted start leaves nothing behind."""

    def __init__(self, path: str | os.PathLike, log=print):
        self.path = Path(path)
        self.log = log
        self.lock = RunLock(self.path)
        self.created: Path | None = None  # the outermost folder this process created for it (None: it existed)
        self._before: set[str] = set()
        self._started = False

    def __enter__(self) -> RunFolder:
        missing = self.path.absolute()
        while not missing.parent.exists():
            missing = missing.parent
        self.created = missing if not self.path.exists() else None
        self.path.mkdir(parents=True, exist_ok=True)
        self._before = {p.name for p in self.path.iterdir()}
        try:
            stale = self.lock.acquire()
        except BaseException:
            self._remove_added()
            raise
        if not self.lock.supported:
            self.log(f"{self.path}: this filesystem has no file locks; nothing stops a second process using it")
        if stale:
            self.log(f"{self.path}: taking over from a process that ended without releasing it "
                     f"({describe_holder(stale)})")
        return self

    def started(self) -> None:
        """The run now exists in the folder: from here a failure keeps everything for a resume."""
        self._started = True

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc is not None and not self._started:
                self._remove_added()
        finally:
            self.lock.release()

    def _remove_added(self) -> None:
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
            return
        for p in self.path.iterdir():
            if p.name in self._before:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def positive(kind: type = int):
    """An argparse `type`: a number of `kind` greater than zero (argparse names the flag in its error)."""

    def parse(text: str):
        value = kind(text)
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid int value" message names the type
    return parse


def check_writable_folder(path: str | os.PathLike, flag: str = "--out") -> None:
    """Refuse (ValueError) a path that is a file or cannot become a folder, before anything is written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {path} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: permission denied to write in {existing}")


class DiskFull(OSError):
    """A write failed for lack of space; the message says what was removed and what was kept."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it chains) comes from a full disk or an exhausted quota. Some writers
    (DCP's per-rank failures, safetensors) carry it only in their message, so the text is checked too."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def failure(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one line) for an expected failure; None for anything else (a bug: let its traceback show)."""
    if isinstance(exc, Interrupted):
        return exc.exit_code, str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT, "stopped by SIGINT"
    if isinstance(exc, RunError):
        return EXIT_RUN_FAILED, str(exc)
    if isinstance(exc, ValueError):
        return EXIT_REFUSED, f"error: {exc}"
    where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
    if isinstance(exc, DiskFull):
        return EXIT_SYSTEM, f"error: {exc.strerror}"
    if disk_full(exc):
        return EXIT_SYSTEM, f"error: no space left on device{where}"
    if isinstance(exc, OSError):
        return EXIT_SYSTEM, f"error: {exc.strerror or exc}{where}"
    return None


def resume_command(prog: str, args: argparse.Namespace, drop: tuple[str, ...] = ("resume", "auto_resume"),
                   add: str = "--resume") -> str:
    """The command line that resumes a run: `prog`, the options in `args` that were given (flags named from their
    dests), without `drop`, plus `add`. Under torchrun the launcher's own options are left for the user."""
    words = []
    for dest, value in vars(args).items():
        if dest in drop or dest in ("command", "func") or value is None or value is False:
            continue
        flag = "--" + dest.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    words.append(add)
    if "RANK" in os.environ:
        return "torchrun <options> -m k3.cli " + " ".join(prog.split()[1:]) + " " + shlex.join(words)
    return prog + " " + shlex.join(words)
