"""Run metrics: one JSON object per line in `metrics.jsonl`, and the PNG plots drawn from it.

Records carry a `kind` ("train", "eval", "event"), the optimizer `step` and their values. On resume the
file is cut back to the checkpoint's step, so the log of a resumed run equals an uninterrupted one.
The loop redraws the plots at every checkpoint; each PNG is replaced in one step, so a stopped run keeps a
complete set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, allow_nan=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        records = []
        for line in self.path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut short by a crash ends the log
        return records

    def truncate_after(self, step: int) -> None:
        """Keep only records up to and including optimizer step `step` (resume from that checkpoint)."""
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)



class NullMetricsLog:
    """The metrics log of ranks other than 0: they compute the same metrics, rank 0 writes them."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def read(self) -> list[dict[str, Any]]:
        return []

def plot_run(metrics_path: str | Path, out_dir: str | Path, title: str = "") -> list[Path]:
    """Draw loss (train/eval), learning rate, grad norm and MoE imbalance; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = MetricsLog(metrics_path).read()
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    def finish(fig, name):
        fig.tight_layout()
        path = out_dir / name
        tmp = out_dir / (name + ".tmp")
        try:
            fig.savefig(tmp, dpi=110, format="png")
            os.replace(tmp, path)
        finally:
            plt.close(fig)
            tmp.unlink(missing_ok=True)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, alpha=0.8, label="train loss")
    if evals:
        ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="held-out loss")
    unigram = next((r["unigram_entropy"] for r in records if "unigram_entropy" in r), None)
    if unigram is not None:
        ax.axhline(unigram, color="gray", ls="--", lw=1, label=f"unigram entropy {unigram:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{title} loss")
    ax.legend()
    ax.grid(alpha=0.3)
    finish(fig, "loss.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].plot([r["step"] for r in train], [r["lr"] for r in train])
    axes[0].set_title("learning rate")
    axes[1].plot([r["step"] for r in train], [r["grad_norm"] for r in train])
    axes[1].set_yscale("log")
    axes[1].set_title("gradient norm (before clipping)")
    for a in axes:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    finish(fig, "optim.png")

    with_moe = [r for r in train if r.get("moe_max_over_mean")]
    if with_moe:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        n_layers = len(with_moe[0]["moe_max_over_mean"])
        steps = [r["step"] for r in with_moe]
        for i in range(n_layers):
            ax.plot(steps, [r["moe_max_over_mean"][i] for r in with_moe], lw=1, label=f"MoE layer {i + 1}")
        ax.axhline(1.0, color="gray", ls="--", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("max / mean expert load")
        ax.set_yscale("log")
        ax.set_title(f"{title} MoE load imbalance (Quantile Balancing)")
        if n_layers <= 12:
            ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
        finish(fig, "moe_balance.png")
    return paths
