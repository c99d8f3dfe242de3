"""A training run's folder: what run.json records (the resolved settings, the length, the revision), which folders
a run may start or resume in, and what a killed process left there to tidy. The main process locks the folder for
the whole call (`k3.runfolder`, shared with the other long-running commands); every refusal comes before anything
is written, and a start that fails removes what it added."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from k3.checkpoint import clean_uncommitted, latest_checkpoint, write_text_atomic
from k3.config import ModelConfig
from k3.parallel.runtime import ParallelRuntime
from k3.runfolder import LOCK_FILE, RunFolder, RunLock
from k3.train.config import TrainConfig
from k3.train.data import remove_unfinished_corpora
from k3.train.runtime import SingleProcess

# Settings that may differ between a run and its resumption (they do not change what is computed).
RESUMABLE_OVERRIDES = {"max_steps", "max_tokens", "max_epochs", "time_budget_min", "eval_every",
                       "checkpoint_every", "keep_checkpoints", "log_every", "device", "max_bad_steps",
                       "context_parallel", "expert_parallel", "moonep", "activation_checkpointing", "optimizer_impl"}
# Where the run folder and the data are: not part of a run's identity (a moved folder, or a path spelled another
# way, is the same run). The data is compared by content instead (`loop.prepare_data`).
LOCATIONS = {"out", "data"}
# The settings that decide the run's length; a resume that gives none keeps the run's own.
LENGTH = ("max_steps", "max_tokens", "max_epochs", "time_budget_min")
# What a start writes before run.json: a folder holding only these (and no run.json) is a start that never finished.
STARTING_ENTRIES = {LOCK_FILE, "tokenizer", "tokenizer.tmp", "data", "config.json", "git.diff", "run.json.tmp"}
# A run's temporary files, left only by a process that was killed while writing them.
TEMPORARY = ("run.json.tmp", "metrics.jsonl.tmp", "tokenizer.tmp", "plots/*.png.tmp", "data/*/meta.json.tmp")


@contextlib.contextmanager
def own_folder(out: Path, cfg: TrainConfig, resume: bool | str, runtime: SingleProcess | ParallelRuntime, log):
    """The run folder for the block: checked by every process (reading only, so refusals come before any write),
    then locked and tidied by the main one. Yields (folder, settings, fresh); `folder.started()` marks the point
    after which a failure keeps what was made (`k3.runfolder.RunFolder`)."""
    if runtime.is_main:
        RunLock(out).check_free()  # a folder in use is the first thing to say about it
    cfg, fresh = _check_out_dir(out, cfg, resume)
    with RunFolder(out, log) if runtime.is_main else _NoFolder() as folder:
        if runtime.is_main:
            cfg, fresh = _check_out_dir(out, cfg, resume)  # again, now that no other process can change it
            _tidy(out, fresh, log)
        runtime.barrier()
        yield folder, cfg, fresh


class _NoFolder:
    """The run folder as ranks other than 0 see it: the main process locks it and tidies it."""

    def __enter__(self) -> _NoFolder:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def started(self) -> None:
        pass


def _check_out_dir(out: Path, cfg: TrainConfig, resume: bool | str) -> tuple[TrainConfig, bool]:
    """(settings, fresh): whether `out` holds no run yet, and what to run with (a resumed run keeps its own length
    unless `cfg` gives one). Refuses (ValueError) to mix runs, to resume nothing, to write into a folder holding
    something else, and a new length that ends before the run's last checkpoint. Reads only."""
    if (out / "run.json").exists():
        if resume is False:
            raise ValueError(f"{out} already holds a training run; pass --resume to continue it, "
                             f"or choose another --out")
        stored = TrainConfig.from_dict(_read_run_info(out)["train_config"])
        if all(getattr(cfg, k) is None for k in LENGTH):
            cfg = dataclasses.replace(cfg, **{k: getattr(stored, k) for k in LENGTH})
        new, old = cfg.as_dict(), stored.as_dict()
        differing = sorted(k for k in new if new[k] != old[k] and k not in RESUMABLE_OVERRIDES | LOCATIONS)
        if differing:
            raise ValueError(f"{out} holds a run with different settings ({', '.join(differing)}); "
                             f"resume it with its own settings or choose another --out")
        if _length(cfg) != _length(stored) and (cfg.max_steps or cfg.max_tokens):
            total = cfg.max_steps or max(1, cfg.max_tokens // cfg.tokens_per_step)
            ckpt = latest_checkpoint(out / "checkpoints")
            at = int(ckpt.name.split("_")[1]) if ckpt is not None else 0
            if total < at:
                raise ValueError(f"{out} has a checkpoint at step {at}; a length of {total} steps would end "
                                 f"before it (pass a larger --max-steps or --max-tokens)")
        return cfg, False
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        if resume is True:
            why = "it does not exist" if not out.exists() else "it is empty"
            raise ValueError(f"there is no run to resume in {out} ({why}); start one without --resume "
                             f"(or with --auto-resume)")
        return cfg, True
    if LOCK_FILE in entries and set(entries) <= STARTING_ENTRIES:
        return cfg, True  # a start that never finished: begun again
    if "checkpoints" in entries:
        raise ValueError(f"{out} holds checkpoints but no run.json (a damaged run folder?); k3 leaves it as it is: "
                         f"choose another --out")
    raise ValueError(f"{out} exists and is not a k3 training run (no run.json; it holds "
                     f"{', '.join(entries[:4])}{', …' if len(entries) > 4 else ''}); choose another --out")


def _tidy(out: Path, fresh: bool, log) -> None:
    """What a killed process left, removed by the main process under the folder's lock. A start that never
    finished is rebuilt from nothing; a run loses its unfinished checkpoints, corpora and temporary files."""
    if fresh:
        leftovers = sorted(p for p in out.iterdir() if p.name != LOCK_FILE)
        if leftovers:
            log(f"{out} holds a run that never finished starting; starting it again")
        _remove(leftovers)
        return
    temporary = sorted(p for pattern in TEMPORARY for p in out.glob(pattern))
    _remove(temporary)
    removed = (clean_uncommitted(out / "checkpoints") + remove_unfinished_corpora(out / "data")
               + [p.name for p in temporary])
    if removed:
        log(f"{out}: removed what an interrupted process left unfinished: {', '.join(removed)}")


def _remove(paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def write_run_info(cfg: TrainConfig, out: Path, model_config: ModelConfig, total_steps: int, world_size: int) -> None:
    """run.json (the resolved settings, step count, revision and versions), config.json and git.diff. run.json is
    written last and whole: its presence means the run exists."""
    git = git_state()
    where = {k: str(Path(getattr(cfg, k)).resolve()) for k in LOCATIONS if getattr(cfg, k) is not None}
    run_info = {"train_config": dataclasses.replace(cfg, **where).as_dict(), "total_steps": total_steps,
                "git_revision": git["revision"], "python": sys.version, "torch": torch.__version__,
                "world_size": world_size}
    model_config.save(out / "config.json")
    (out / "git.diff").write_text(git["diff"])
    write_text_atomic(out / "run.json", json.dumps(run_info, indent=2))


def git_state() -> dict[str, str]:
    """The source revision and the diff of uncommitted changes, when running from a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        diff = subprocess.run(["git", "diff", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"revision": "unknown", "diff": ""}
    return {"revision": rev.stdout.strip() or "unknown", "diff": diff.stdout}


def stored_total_steps(out: Path, cfg: TrainConfig) -> int | None:
    """The step count run.json records, when `cfg` keeps the run's length (None: a new length, to be resolved)."""
    stored = _read_run_info(out)
    if _length(cfg) == _length(TrainConfig.from_dict(stored["train_config"])):
        return stored["total_steps"]
    return None


def retarget_length(out: Path, cfg: TrainConfig, step: int, total_steps: int, is_main: bool, log) -> bool:
    """A resume that gives a new length: the run at `step` now ends at `total_steps` (run.json updated by the main
    process, logged). Returns whether the length changed; refuses (ValueError) a length that ends before `step`."""
    info = _read_run_info(out)
    if info["total_steps"] == total_steps and _length(cfg) == _length(TrainConfig.from_dict(info["train_config"])):
        return False
    if total_steps < step:
        raise ValueError(f"{out} is at step {step}; a length of {total_steps} steps would end before "
                         f"it (give a longer time budget, or a larger --max-steps or --max-tokens)")
    if is_main:
        log(f"the run's length is now {total_steps} steps (was {info['total_steps']})")
        info["train_config"].update({k: getattr(cfg, k) for k in LENGTH})
        info["total_steps"] = total_steps
        write_text_atomic(out / "run.json", json.dumps(info, indent=2))
    return True


def _length(cfg: TrainConfig) -> tuple:
    return tuple(getattr(cfg, k) for k in LENGTH)


def _read_run_info(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / "run.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{out / 'run.json'} cannot be read ({e}); the run folder is damaged") from e
