"""The README's `make demo` claim: what the tiny preset reaches in its 8-minute CPU budget, from a fresh clone.

    git clone <repository> fresh && cd fresh && bash .ci/run 2>&1 | tee ci.log && make demo
    python benchmarks/demo.py --run runs/tiny --suite-log ci.log

reads the run folder `make demo` left (its metrics log: steps, tokens, training time, the last train and
held-out losses against the corpus's unigram entropy) and, with --suite-log, the test suite's pytest summary,
and writes benchmarks/results/demo-cpu.json. Nothing is measured here: the numbers are the run's own.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import save_result  # noqa: E402

from k3.train.metrics import MetricsLog  # noqa: E402


def run_table(run: Path) -> dict:
    records = MetricsLog(run / "metrics.jsonl").read()
    train = [r for r in records if r.get("kind") == "train" and not r.get("skipped")]
    evals = [r for r in records if r.get("kind") == "eval"]
    unigram = next(r["unigram_entropy"] for r in records if "unigram_entropy" in r)
    if not train or not evals:
        raise SystemExit(f"{run}: no training steps or evaluations in metrics.jsonl")
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in train)
    return {"columns": ["steps", "tokens", "minutes in steps (evaluations, checkpoints apart)", "train loss", "held-out loss (nats/token)",
                        "unigram entropy (nats/token)"],
            "rows": [[train[-1]["step"], train[-1]["tokens_seen"], round(seconds / 60, 1),
                      round(train[-1]["loss"], 3), round(evals[-1]["loss"], 3), round(unigram, 3)]],
            "command": "make demo"}


def suite_table(log: Path) -> dict:
    text = log.read_text()
    found = re.findall(r"(\d+) passed(?:, (\d+) skipped)?.* in ([\d.]+)s", text)
    if not found:
        raise SystemExit(f"{log}: no pytest summary line")
    passed, skipped, seconds = found[-1]
    return {"columns": ["passed", "skipped", "pytest s"], "rows": [[int(passed), int(skipped or 0), float(seconds)]],
            "command": "bash .ci/run"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, default=Path("runs/tiny"), help="the run folder make demo wrote")
    p.add_argument("--suite-log", type=Path, help="the output of bash .ci/run (its pytest summary line)")
    args = p.parse_args()
    tables = {"demo": run_table(args.run)}
    # the commit measured is the run's own (run.json), not this checkout's
    commit = json.loads((args.run / "run.json").read_text()).get("git_revision", "unknown")[:7]
    if args.suite_log:
        tables["suite"] = suite_table(args.suite_log)
    save_result("demo", "`make demo` and `make test` from a fresh clone on a CPU machine: the tiny preset trained on "
                "the Python standard library's sources for an 8-minute budget, its held-out loss against the "
                "corpus's unigram entropy; the default test suite", tables,
                command="git clone <repository> fresh && cd fresh && bash .ci/run && make demo", slug="cpu",
                commit=commit)
    for name, t in tables.items():
        print(name, dict(zip(t["columns"], t["rows"][0])))


if __name__ == "__main__":
    main()
