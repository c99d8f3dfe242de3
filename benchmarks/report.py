"""Regenerate the measurement tables of README.md and docs/*.md from benchmarks/results/*.json.

A doc marks each table it takes from a result file with a block

    <!-- results: train-throughput-h200.json#mfu -->
    (generated: the table, then one line with the command, the device and the commit)
    <!-- /results -->

and this script rewrites what lies between the two markers. The result files' format is the one
`benchmarks/provenance.py`'s `save_result` writes. A table may carry its own "command", "commit", "device" or
"versions" (those of the run that produced it, when the file holds tables of several runs), a "note" (one
line printed under it), and for a table of variants gathered from many runs, "sources" (one command and
commit per row, kept in the file rather than printed).

    python benchmarks/report.py           # rewrite every block
    python benchmarks/report.py --check   # exit 1 listing stale blocks, missing files or tables, bad files
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- results: *(?P<ref>[^ #]+)#(?P<table>[^ ]+?) *-->\n)(?P<body>.*?)(<!-- /results -->)",
                   re.S)
REQUIRED = ("claim", "command", "device", "commit", "tables")


def docs(root: Path = ROOT) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.exists()]


def cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return repr(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def file_problems(name: str, data) -> list[str]:
    """What keeps a result file from being read: missing keys, tables without columns, ragged rows."""
    if not isinstance(data, dict):
        return [f"{name}: not a JSON object"]
    problems = [f"{name}: no {key!r}" for key in REQUIRED if key not in data]
    for key, t in (data.get("tables") or {}).items():
        if not isinstance(t, dict) or not isinstance(t.get("columns"), list) or not isinstance(t.get("rows"), list):
            problems.append(f"{name}#{key}: a table needs 'columns' and 'rows' lists")
            continue
        width = len(t["columns"])
        problems += [f"{name}#{key}: row {i} has {len(r)} cells for {width} columns"
                     for i, r in enumerate(t["rows"]) if not isinstance(r, list) or len(r) != width]
    return problems


def provenance(data: dict, t: dict, name: str, key: str) -> str:
    """The line under a table: command, device, commit (and versions), the table's own where it has them."""
    get = lambda field: t.get(field, data.get(field))  # noqa: E731
    if "sources" in t:
        line = (f"Measured on {get('device')}; each row's command and commit: `benchmarks/results/{name}`, "
                f"`tables.{key}.sources`.")
    else:
        known = {k: v for k, v in (get("versions") or {}).items() if k in ("torch", "triton", "cuda")}
        versions = ", ".join(f"{k} {v}" for k, v in known.items())
        line = (f"`{get('command')}` on {get('device')}, commit `{get('commit')}`"
                + (f" ({versions})" if versions else "") + f"; `benchmarks/results/{name}`.")
    return (t["note"] + "\n" if t.get("note") else "") + line


def render(name: str, key: str, results: Path = RESULTS) -> str:
    """The markdown that belongs between the markers of `name#key`; raises LookupError if it cannot be made."""
    path = results / name
    if not path.exists():
        raise LookupError(f"no results file {name}")
    data = json.loads(path.read_text())
    problems = file_problems(name, data)
    if problems:
        raise LookupError("; ".join(problems))
    if key not in data["tables"]:
        raise LookupError(f"{name} has no table {key!r} (tables: {', '.join(data['tables'])})")
    t = data["tables"][key]
    lines = ["| " + " | ".join(cell(c) for c in t["columns"]) + " |",
             "|" + "---|" * len(t["columns"])]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in t["rows"]]
    return "\n".join(lines) + "\n\n" + provenance(data, t, name, key) + "\n"


def update(text: str, results: Path = RESULTS) -> tuple[str, list[tuple[int, str, str]]]:
    """(the text with every block regenerated, [(line, reference, problem)] for blocks that could not be)."""
    problems = []

    def fill(m: re.Match) -> str:
        line = text.count("\n", 0, m.start()) + 1
        try:
            body = render(m["ref"], m["table"], results)
        except (LookupError, json.JSONDecodeError) as e:
            problems.append((line, f"{m['ref']}#{m['table']}", str(e)))
            return m.group(0)
        return m.group(1) + body + m.group(5)

    return BLOCK.sub(fill, text), problems


def check(root: Path = ROOT) -> list[str]:
    """Every problem `--check` reports: stale or broken blocks in the docs, unreadable result files."""
    results = root / "benchmarks" / "results"
    problems = []
    for path in sorted(results.glob("*.json")):
        try:
            problems += file_problems(path.name, json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            problems.append(f"{path.name}: not JSON ({e})")
    for doc in docs(root):
        text = doc.read_text()
        new, broken = update(text, results)
        rel = doc.relative_to(root)
        problems += [f"{rel}:{line}: {ref}: {why}" for line, ref, why in broken]
        if new != text:
            old_blocks, new_blocks = BLOCK.finditer(text), BLOCK.finditer(new)
            for old, fresh in zip(old_blocks, new_blocks):
                if old.group(0) != fresh.group(0):
                    line = text.count("\n", 0, old.start()) + 1
                    problems.append(f"{rel}:{line}: {old['ref']}#{old['table']}: out of date")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if any block is out of date")
    args = ap.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(p)
        return 1 if problems else 0
    failed = 0
    for doc in docs():
        text = doc.read_text()
        new, broken = update(text)
        for line, ref, why in broken:
            print(f"{doc.relative_to(ROOT)}:{line}: {ref}: {why}")
        failed += len(broken)
        if new != text:
            doc.write_text(new)
            print(f"updated {doc.relative_to(ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
