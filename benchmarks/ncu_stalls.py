"""Where a kernel's warps stall, from an Nsight Compute source export: the stall reasons' shares and the SASS
instructions that hold the most samples, per kernel.

    ncu ... --section SourceCounters --section WarpStateStats -o rep python3 -m benchmarks.kda_ncu
    ncu -i rep.ncu-rep --page source --csv --print-source sass | gzip > source.csv.gz
    python benchmarks/ncu_stalls.py source.csv.gz [kernel ...] [--top 14]

ncu charges a stall to the instruction that cannot issue: a `long_sb` stall sits on the first consumer of a late
global load (or on a write to a register that an in-flight memory instruction still reads), a `short_sb` one on the
consumer of a shared-memory load or an MUFU result.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(path: str) -> dict[str, list[dict]]:
    """{kernel name: its SASS rows} of a (gzipped) `--page source --csv --print-source sass` export."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    out = {}
    for part in text.split('"Kernel Name",')[1:]:
        header, body = part.split("\n", 1)
        out[header.strip().strip(",").strip('"')] = list(csv.DictReader(io.StringIO(body)))
    return out


def report(name: str, rows: list[dict], top: int) -> None:
    total = sum(int(r[SAMPLES] or 0) for r in rows)
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    shares = {c[6:]: sum(int(r[c] or 0) for r in rows) / max(total, 1) for c in reasons}
    print(f"== {name}: {total} samples over {len(rows)} instructions")
    print("   " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(shares.items(), key=lambda x: -x[1])[:7]))
    for i in sorted(range(len(rows)), key=lambda i: -int(rows[i][SAMPLES] or 0))[:top]:
        r = rows[i]
        mine = sorted(((int(r[c] or 0), c[6:]) for c in reasons), reverse=True)[:2]
        print(f"   {i:5d} {100 * int(r[SAMPLES]) / total:4.1f}%  {r['Source'].strip()[:64]:64s} "
              + ", ".join(f"{reason} {n}" for n, reason in mine))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export", help="the source-page CSV, gzipped or not")
    p.add_argument("kernels", nargs="*", help="kernel names (default: every kernel in the export)")
    p.add_argument("--top", type=int, default=14, help="instructions to list per kernel")
    args = p.parse_args()
    for name, rows in kernels(args.export).items():
        if not args.kernels or name in args.kernels:
            report(name, rows, args.top)


if __name__ == "__main__":
    main()
