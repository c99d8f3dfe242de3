"""Which code a benchmark measured: the git commit, for the JSON records of every benchmark script."""

from __future__ import annotations

import os
from pathlib import Path


def git_sha(length: int = 12) -> str:
    """The checked-out commit, read from .git without running git (dirty state unknown), or "unknown".

    K3_GIT_SHA overrides it: the lent GPU machine runs a copy of the working tree whose .git can be stale (session
    7's records said 2a75e83 for later code), so session scripts pass the commit in.
    """
    if os.environ.get("K3_GIT_SHA"):
        return os.environ["K3_GIT_SHA"][:length]
    root = Path(__file__).resolve().parents[1] / ".git"
    try:
        head = (root / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head[:length]
        ref = head.split(" ", 1)[1]
        if (root / ref).exists():
            return (root / ref).read_text().strip()[:length]
        for line in (root / "packed-refs").read_text().splitlines():
            if line.endswith(ref):
                return line.split()[0][:length]
    except OSError:
        pass
    return "unknown"
