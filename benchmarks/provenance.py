"""What a benchmark measured, on what, and where its result goes: `save_result` writes
`benchmarks/results/<name>-<device>.json` in the one format `benchmarks/report.py` reads.

A result file holds one claim on one kind of device:

    {"claim": ..., "command": ..., "device": ..., "commit": ..., "versions": {...},
     "tables": {"<table>": {"columns": [...], "rows": [[...], ...]}}, "raw": {...}}

Re-running a script overwrites the tables it produces and keeps the file's other tables (a script run with
another option, or the "variants" table of what was tried); a kept table carries the command, commit and
versions of the run that produced it, so every table says where its numbers come from.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROVENANCE_KEYS = ("command", "device", "commit", "versions")


def git_sha(length: int = 7) -> str:
    """The checked-out commit, "+dirty" when tracked files differ from it, or "unknown".

    K3_GIT_SHA overrides it: a device machine may run a copy of the working tree whose .git is stale.
    """
    if os.environ.get("K3_GIT_SHA"):
        return os.environ["K3_GIT_SHA"][:length]
    try:
        sha = subprocess.run(["git", "rev-parse", f"--short={length}", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name() -> str:
    """The GPU as CUDA names it, with its memory, or the CPU model and core count."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def device_slug(gpus: int = 1) -> str:
    """The device part of a result's file name: "h200", "2xh200", "cpu"."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    kind = next((k for k in ("h200", "h100", "a100", "b200", "l40s") if k in name), name.split()[-1])
    return kind if gpus == 1 else f"{gpus}x{kind}"


def versions() -> dict[str, str]:
    """torch, triton and CUDA versions, as far as they are installed."""
    out = {"python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        if torch.version.cuda:
            out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def command_line() -> str:
    """This process's command line, as it would be typed from the repository root."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and not spec.name.endswith("__main__"):
        head = ["python", "-m", spec.name]
    else:
        script = Path(sys.argv[0]).resolve()
        head = ["python", str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def table(columns: list[str], rows: list[list], note: str | None = None) -> dict:
    """One table of a result file; every row as long as `columns`; `note` is printed under it in the docs."""
    assert all(len(row) == len(columns) for row in rows), (columns, rows)
    return {"columns": list(columns), "rows": [list(row) for row in rows]} | ({"note": note} if note else {})


def save_result(name: str, claim: str, tables: dict[str, dict], *, raw: dict | None = None,
                command: str | None = None, slug: str | None = None, out: str | Path | None = None,
                commit: str | None = None, device: str | None = None) -> Path:
    """Write (or update) `<out>/<name>-<slug>.json` and return its path.

    name: the claim's file name stem, e.g. "train-throughput"; slug: the device part (`device_slug()` by
    default); out: the results folder (K3_RESULTS, else `benchmarks/results`). The tables of this run replace the
    tables of the same names; the file's other tables stay, stamped with the provenance they were measured with.
    command, commit, device: what was measured when it is not this process (a report merged from earlier runs).
    """
    path = Path(out or os.environ.get("K3_RESULTS") or RESULTS) / f"{name}-{slug or device_slug()}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    kept = {}
    for key, old_table in old.get("tables", {}).items():
        if key not in tables:
            kept[key] = {k: old.get(k) for k in PROVENANCE_KEYS if old.get(k) is not None} | old_table
    record = {"claim": claim, "command": command or command_line(), "device": device or device_name(),
              "commit": commit or git_sha(),
              "versions": versions(), "tables": kept | tables}
    if raw is not None:
        record["raw"] = raw
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path
