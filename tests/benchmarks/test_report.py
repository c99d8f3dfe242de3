"""benchmarks/report.py: the repository's measurement tables match benchmarks/results/, and the rewrite and the
check do what they say on a small tree."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402
from benchmarks.provenance import save_result, table  # noqa: E402


def test_repository_tables_are_current():
    """Every results block in README.md and docs/*.md is what `python benchmarks/report.py` writes, and every
    results file is readable."""
    problems = report.check(ROOT)
    assert problems == [], "run `python benchmarks/report.py`:\n" + "\n".join(problems)


def tree(tmp_path: Path, doc: str) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "page.md").write_text(doc)
    return tmp_path


def test_blocks_are_rewritten_and_checked(tmp_path, monkeypatch):
    root = tree(tmp_path, "# Page\n\n<!-- results: thing-cpu.json#speed -->\nold\n<!-- /results -->\n\nafter\n")
    results = root / "benchmarks" / "results"
    assert any("no results file thing-cpu.json" in p for p in report.check(root))
    monkeypatch.setenv("K3_RESULTS", str(results))
    save_result("thing", "how fast a thing is", {"speed": table(["case", "ms"], [["a", 1.5], ["b", None]])},
                command="python benchmarks/thing.py", slug="cpu")
    problems = report.check(root)
    assert problems == ["docs/page.md:3: thing-cpu.json#speed: out of date"], problems

    doc = root / "docs" / "page.md"
    new, broken = report.update(doc.read_text(), results)
    assert broken == []
    doc.write_text(new)
    assert report.check(root) == []
    text = doc.read_text()
    assert "| case | ms |\n|---|---|\n| a | 1.5 |\n| b | — |\n" in text
    assert "`python benchmarks/thing.py` on " in text and text.endswith("<!-- /results -->\n\nafter\n")

    # a re-run that writes another table keeps this one, with the provenance it was measured with
    save_result("thing", "how fast a thing is", {"size": table(["case", "MB"], [["a", 3]])},
                command="python benchmarks/thing.py --size", slug="cpu")
    record = json.loads((results / "thing-cpu.json").read_text())
    assert set(record["tables"]) == {"speed", "size"}
    assert record["tables"]["speed"]["command"] == "python benchmarks/thing.py"
    assert record["command"] == "python benchmarks/thing.py --size"
    assert report.check(root) == []


def test_missing_table_and_bad_file_are_reported(tmp_path):
    root = tree(tmp_path, "<!-- results: thing-cpu.json#nope -->\n<!-- /results -->\n")
    results = root / "benchmarks" / "results"
    (results / "thing-cpu.json").write_text(json.dumps(
        {"claim": "c", "command": "x", "device": "d", "commit": "abc", "tables": {"t": {"columns": ["a", "b"],
                                                                                    "rows": [[1]]}}}))
    problems = report.check(root)
    assert "thing-cpu.json#t: row 0 has 1 cells for 2 columns" in problems
    assert any(p.startswith("docs/page.md:1: thing-cpu.json#nope") for p in problems), problems
