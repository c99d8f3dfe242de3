"""Session 25: draw the inference pipeline's timelines that `s25_timeline.py` printed into a run's log, one panel per
chosen timeline, a row per stream (prepare on the current stream, state passes on the side stream).

    python3 benchmarks/sessions/s25_timeline_plot.py LOG OUT.png --pick "TITLE::SUBSTRING" [--pick ...]

SUBSTRING selects the `[timeline]` header line (its first match); TITLE labels the panel.
"""
from __future__ import annotations

import argparse
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROW = re.compile(r"^\s+stream\s+(\d+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$")


def timelines(path: str) -> list[tuple[str, list[tuple[int, str, float, float]]]]:
    """[(header, [(stream, kernel, start µs, end µs)])] in the log's order."""
    out = []
    for line in open(path, encoding="utf-8"):
        if line.startswith("[timeline]"):
            out.append((line.strip(), []))
        elif out and (m := ROW.match(line.rstrip("\n"))):
            out[-1][1].append((int(m[1]), m[2], float(m[3]), float(m[4])))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("out")
    ap.add_argument("--pick", action="append", required=True, metavar="TITLE::SUBSTRING")
    args = ap.parse_args()
    found = timelines(args.log)
    picks = []
    for pick in args.pick:
        title, _, key = pick.partition("::")
        match = next((t for t in found if key in t[0]), None)
        if match is None:
            ap.error(f"no [timeline] header contains {key!r}")
        picks.append((title, match[1]))
    end = max(b for _, rows in picks for _, _, _, b in rows)
    fig, axes = plt.subplots(len(picks), 1, figsize=(10, 1.6 * len(picks) + 0.6), sharex=True, squeeze=False)
    colours = {"_prefill_prepare": "tab:blue", "_prefill_state": "tab:orange"}
    for ax, (title, rows) in zip(axes[:, 0], picks):
        streams = sorted({s for s, *_ in rows})
        for s, name, a, b in rows:
            y = streams.index(s)
            ax.barh(y, b - a, left=a, height=0.6, color=colours.get(name, "tab:gray"), edgecolor="black", lw=0.5)
            ax.text((a + b) / 2, y, f"{b - a:.0f}", ha="center", va="center", fontsize=7)
        total = max(b for *_, b in rows)
        ax.set_yticks(range(len(streams)), ["prepare (current stream)" if i == 0 else "state pass (side stream)"
                                            for i in range(len(streams))])
        ax.set_title(f"{title}: {total:.0f} µs", fontsize=9, loc="left")
        ax.set_xlim(0, end * 1.02)
    axes[-1, 0].set_xlabel("µs from the first kernel's start (bar labels: each kernel's µs)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
