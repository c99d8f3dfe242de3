"""The front end every training command shares (`k3 train`, `k3 sft`, `k3 rl`, `k3 mopd`, `k3 train-draft`): stop signals installed before torch loads,
expected failures as one line and an exit code (`k3.runfolder`), and the closing report of a run.

Exit codes: 0 done (or nothing left to do), 1 system failure, 2 refused, 3 the run cannot continue, 128 + N stopped
by signal N; a stop or a system failure prints the command line that resumes the run. Imports nothing heavy at
module level: a Ctrl-C while torch loads is a clean stop too, not a traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3.runfolder import Interrupted, StopSignals, failure, resume_command


def run_training_command(prog: str, args: argparse.Namespace, out: Path, start: Callable[[StopSignals], Any],
                         done: Callable[[Any], str] | None = None, unit: str = "step",
                         longer: str = "--max-steps or --max-tokens",
                         drop: tuple[str, ...] = ("resume", "auto_resume")) -> int:
    """Run `start(stop)` (which imports torch, trains and returns a summary) as command `prog` (e.g. "k3 train")
    with the parsed `args`, whose run folder is `out`; returns the exit code.

    The summary has `stopped`, `checkpoint` and its progress in `unit`s: `<unit>s`, `total_<unit>s`,
    `start_<unit>` (a `k3.train.loop.RunSummary` counts steps). `done(summary)`: the closing line of a run that
    trained (default: `k3 train`'s); `longer`: the options that lengthen a complete run; `drop`: the arguments the
    printed resume command leaves out (`k3.runfolder.resume_command`)."""
    main_rank = os.environ.get("RANK", "0") == "0"
    resume_with = "resume with: " + resume_command(prog, args, drop=drop)
    # installed before torch is imported: a Ctrl-C while it loads is a clean stop too, not a traceback
    with StopSignals() as stop:
        try:
            summary = start(stop)
        except BaseException as e:
            outcome = failure(e)
            if outcome is None:
                raise
            code, line = outcome
            exists = (out / "run.json").exists()
            if isinstance(e, Interrupted):
                if not main_rank:
                    return code
                # committed checkpoints, found without importing torch (the stop may have come while it loaded)
                last = max((p.parent for p in (out / "checkpoints").glob("step_*/COMMITTED")), default=None)
                line += (f" at once; the last checkpoint is {last or 'not written yet'}" if exists
                         else " before the run started (nothing to save)")
            elif os.environ.get("WORLD_SIZE", "1") != "1":
                line = f"rank {os.environ.get('RANK')}: {line}"
            print(f"{prog}: {line}", file=sys.stderr)
            if exists and main_rank and isinstance(e, (Interrupted, OSError)):
                print(resume_with, file=sys.stderr)
            return code
        finally:
            dist = sys.modules.get("torch.distributed")  # not imported again if a stop came while torch loaded
            if dist is not None and dist.is_initialized():
                dist.destroy_process_group()
    if not main_rank:
        return 0
    at, total, first = (getattr(summary, name) for name in (f"{unit}s", f"total_{unit}s", f"start_{unit}"))
    if summary.stopped:
        print(f"{prog}: stopped by {summary.stopped} at {unit} {at} of {total}; checkpoint {summary.checkpoint}; "
              f"plots in {out / 'plots'}", file=sys.stderr)
        print(resume_with, file=sys.stderr)
        return 128 + signal.Signals[summary.stopped]
    if at == first:
        print(f"the run in {out} is complete ({at} of {total} {unit}s, checkpoint {summary.checkpoint}); to train "
              f"on, resume it with a larger {longer}")
        return 0
    print((done or trained_line)(summary))
    return 0


def trained_line(summary: Any) -> str:
    """`k3 train`'s and `k3 sft`'s closing line (a `k3.train.loop.RunSummary`)."""
    resumed = f" (resumed at step {summary.start_step})" if summary.start_step else ""
    return (f"trained {summary.steps} steps{resumed}, {summary.tokens:,} tokens in {summary.seconds / 60:.1f} min: "
            f"train loss {summary.final_train_loss:.3f}, held-out loss {summary.final_eval_loss:.3f} nats/token "
            f"(unigram entropy of the corpus {summary.unigram_entropy:.3f}); "
            f"checkpoint {summary.checkpoint}; plots in {summary.out / 'plots'}")
