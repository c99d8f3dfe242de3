"""Per-sandbox cgroups on v1 (one hierarchy per controller) or v2 (the unified tree), detected at start.

Each sandbox gets one cgroup (`k3-sandbox/<id>`) with a memory limit, a pids limit and a CPU quota, plus the
freezer for pause. Commands enter it before bubblewrap starts (the launcher writes its own pid to every
`cgroup.procs`), so nothing a command forks can be outside it; killing a sandbox freezes the cgroup, kills
every member and thaws it, so a fork bomb cannot outrun the kill.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PARENT = "k3-sandbox"
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class Layout:
    version: int  # 1 or 2
    parents: dict[str, Path]  # v1: controller -> k3-sandbox folder in its hierarchy; v2: {"unified": folder}

    def describe(self) -> str:
        return f"cgroup v{self.version} under " + ", ".join(str(p) for p in self.parents.values())


def _writable_parent(hierarchy: Path) -> Path:
    parent = hierarchy / PARENT
    parent.mkdir(exist_ok=True)
    probe = parent / f"probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    probe.rmdir()
    return parent


def detect() -> Layout:
    """The cgroup layout this manager can write to; OSError with the reason when there is none."""
    if (ROOT / "cgroup.controllers").exists():
        available = (ROOT / "cgroup.controllers").read_text().split()
        missing = {"memory", "pids", "cpu"} - set(available)
        if missing:
            raise OSError(f"cgroup v2 lacks controllers {sorted(missing)}")
        parent = _writable_parent(ROOT)
        for folder in (ROOT, parent):
            (folder / "cgroup.subtree_control").write_text("+memory +pids +cpu")
        return Layout(2, {"unified": parent})
    missing = [c for c in V1_CONTROLLERS if not (ROOT / c / "cgroup.procs").exists()]
    if missing:
        raise OSError(f"no cgroup v2 and no v1 hierarchies for {missing} under {ROOT}")
    try:
        return Layout(1, {c: _writable_parent(ROOT / c) for c in V1_CONTROLLERS})
    except OSError as e:
        raise OSError(f"cgroup v1 hierarchies are not writable: {e}") from e


class Cgroup:
    """One sandbox's cgroup (a folder per v1 hierarchy, or one v2 folder)."""

    def __init__(self, layout: Layout, name: str):
        self.layout = layout
        self.dirs = {c: p / name for c, p in layout.parents.items()}

    def _file(self, controller: str, v1_name: str, v2_name: str) -> Path:
        if self.layout.version == 2:
            return self.dirs["unified"] / v2_name
        return self.dirs[controller] / v1_name

    def exists(self) -> bool:
        return all(d.is_dir() for d in self.dirs.values())

    def create(self, memory_bytes: int, pids: int, cpus: float) -> None:
        for d in self.dirs.values():
            d.mkdir(exist_ok=True)
        quota = max(1000, int(cpus * CPU_PERIOD_US))
        if self.layout.version == 2:
            d = self.dirs["unified"]
            (d / "memory.max").write_text(str(memory_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(pids))
            (d / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
            return
        mem = self.dirs["memory"]
        (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
        if (mem / "memory.memsw.limit_in_bytes").exists():
            (mem / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        (self.dirs["pids"] / "pids.max").write_text(str(pids))
        (self.dirs["cpu"] / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))

    def procs_files(self) -> list[Path]:
        """The files a launcher writes its pid into to join this cgroup."""
        return [d / "cgroup.procs" for d in self.dirs.values()]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for f in self.procs_files():
            try:
                found |= {int(x) for x in f.read_text().split()}
            except FileNotFoundError:
                pass
        return found

    def memory_bytes(self) -> int:
        return int(self._file("memory", "memory.usage_in_bytes", "memory.current").read_text())

    def freeze(self) -> None:
        self._set_frozen(True)

    def thaw(self) -> None:
        self._set_frozen(False)

    def _set_frozen(self, frozen: bool) -> None:
        if self.layout.version == 2:
            (self.dirs["unified"] / "cgroup.freeze").write_text("1" if frozen else "0")
            want, f, key = ("1" if frozen else "0"), self.dirs["unified"] / "cgroup.events", "frozen "
        else:
            (self.dirs["freezer"] / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
            want, f, key = ("FROZEN" if frozen else "THAWED"), self.dirs["freezer"] / "freezer.state", ""
        # freezing is asynchronous: wait until every task has stopped (or started again)
        for _ in range(2000):
            text = f.read_text()
            value = text.strip() if not key else next(l[len(key):] for l in text.splitlines() if l.startswith(key))
            if value == want:
                return
            time.sleep(0.0005)
        raise OSError(f"cgroup {self.dirs} did not reach {want}")

    def frozen(self) -> bool:
        if self.layout.version == 2:
            return (self.dirs["unified"] / "cgroup.freeze").read_text().strip() == "1"
        return (self.dirs["freezer"] / "freezer.state").read_text().strip() == "FROZEN"

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL every member; returns once the cgroup is empty."""
        if not self.exists():
            return
        if self.layout.version == 2 and (self.dirs["unified"] / "cgroup.kill").exists():
            (self.dirs["unified"] / "cgroup.kill").write_text("1")
        else:
            self.freeze()
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.thaw()
        deadline = time.monotonic() + timeout
        while self.pids():
            if time.monotonic() > deadline:
                raise OSError(f"processes {sorted(self.pids())} survived SIGKILL in {self.dirs}")
            time.sleep(0.002)

    def remove(self) -> None:
        self.kill()
        for d in self.dirs.values():
            if d.is_dir():
                d.rmdir()
