"""Warp-stall samples of one kernel in an Nsight Compute source export, by SASS opcode and by instruction.

    ncu -i kda.ncu-rep --page source --csv --print-source sass | gzip > kda_source.csv.gz
    python benchmarks/ncu_source.py kda_source.csv.gz 10 --top 30

The export holds one section per profiled kernel launch (`"Kernel Name","<name>",` then a CSV table); `section` is
its 1-based index, in launch order (`benchmarks/kda_ncu.py` profiles one forward, then one forward + backward)."""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", help="the source-page CSV (.gz or plain)")
    ap.add_argument("section", type=int, help="1-based kernel section")
    ap.add_argument("--top", type=int, default=25, help="instructions to list")
    args = ap.parse_args()
    opener = gzip.open if args.path.endswith(".gz") else open
    with opener(args.path, "rt") as f:
        sections = f.read().split('"Kernel Name",')
    section = sections[args.section]
    name, body = section.split("\n", 1)
    rows = list(csv.DictReader(io.StringIO(body)))
    stall_cols = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    samples = [int(r["Warp Stall Sampling (All Samples)"] or 0) for r in rows]
    total = sum(samples) or 1
    print(name, "instructions", len(rows), "samples", total)
    by_op, op_stalls = collections.Counter(), collections.defaultdict(collections.Counter)
    for r, s in zip(rows, samples):
        words = r["Source"].split()
        op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0] if words else "")
        op = op.split(".")[0]
        by_op[op] += s
        for c in stall_cols:
            op_stalls[op][c] += int(r[c] or 0)
    for op, s in by_op.most_common(14):
        reasons = " ".join(f"{c[6:]}={100 * v / total:.1f}" for c, v in op_stalls[op].most_common(3) if v)
        print(f"{op:10s} {100 * s / total:5.1f}%  {reasons}")
    print("--- top instructions (index, share, SASS, two main stall reasons)")
    for i in sorted(sorted(range(len(rows)), key=lambda i: -samples[i])[:args.top]):
        top = sorted(((int(rows[i][c] or 0), c[6:]) for c in stall_cols), reverse=True)[:2]
        print(f"{i:5d} {100 * samples[i] / total:5.1f}% {rows[i]['Source'].strip()[:60]:60s} {top}")


if __name__ == "__main__":
    main()
