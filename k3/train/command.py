"""The front end every training command shares (`k3 train`, `k3 sft`): stop signals installed before torch loads,
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


def run_training_command(prog: str, args: argparse.Namespace, out: Path, start: Callable[[StopSignals], Any]) -> int:
    """Run `start(stop)` (which imports torch, trains and returns a `k3.train.loop.RunSummary`) as command `prog`
    (e.g. "k3 train") with the parsed `args`, whose run folder is `out`; returns the exit code."""
    main_rank = os.environ.get("RANK", "0") == "0"
    resume_with = "resume with: " + resume_command(prog, args)
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
    if summary.stopped:
        print(f"{prog}: stopped by {summary.stopped} at step {summary.steps} of {summary.total_steps}; checkpoint "
              f"{summary.checkpoint}; plots in {out / 'plots'}", file=sys.stderr)
        print(resume_with, file=sys.stderr)
        return 128 + signal.Signals[summary.stopped]
    if summary.steps == summary.start_step:
        print(f"the run in {out} is complete ({summary.steps} of {summary.total_steps} steps, checkpoint "
              f"{summary.checkpoint}); to train on, resume it with a larger --max-steps or --max-tokens")
        return 0
    resumed = f" (resumed at step {summary.start_step})" if summary.start_step else ""
    print(f"trained {summary.steps} steps{resumed}, {summary.tokens:,} tokens in {summary.seconds / 60:.1f} min: "
          f"train loss {summary.final_train_loss:.3f}, held-out loss {summary.final_eval_loss:.3f} nats/token "
          f"(unigram entropy of the corpus {summary.unigram_entropy:.3f}); "
          f"checkpoint {summary.checkpoint}; plots in {summary.out / 'plots'}")
    return 0
