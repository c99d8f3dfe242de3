"""Crash-safe training checkpoints, and `load_trained`: the one loader of a trained run or checkpoint.

A checkpoint is a directory `step_000123/` holding:
- `model.safetensors` — every parameter and persistent buffer (Quantile Balancing biases included);
- `config.json` — the released-layout model config; `tokenizer/` — the run's tokenizer files;
- `train_state.pt` — optimizer, scheduler, data position, RNG states, step and token counters;
- `manifest.json` — size and SHA-256 of every file above;
- `COMMITTED` — written last.

Writing goes to `step_000123.tmp/`, every file is fsynced, then the directory is renamed into place and
the parent directory fsynced, so a crash at any point leaves either the complete checkpoint or a `.tmp`
directory that loading ignores. Anything without its `COMMITTED` marker (a `.tmp` directory, or a
`step_N/` that lost it) is unfinished: `clean_uncommitted` removes it when a run starts, and a save over
it replaces it, so it never blocks a step. Loading verifies the manifest, so a truncated or corrupted file
is reported with a clear error instead of being loaded. The newest `keep` committed checkpoints are kept.
A write that fails for lack of space raises an OSError with errno ENOSPC (torch.save's own stream error is
traced back to it), so callers can say so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

COMMITTED = "COMMITTED"
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that is missing, partial, corrupted or incompatible."""


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def committed_checkpoints(root: str | Path) -> list[Path]:
    """Committed checkpoint directories under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and d.name.startswith("step_") and not d.name.endswith(".tmp")
            and (d / COMMITTED).exists()]
    return sorted(dirs, key=lambda d: int(d.name.split("_")[1]))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = committed_checkpoints(root)
    return found[-1] if found else None


def clean_uncommitted(root: str | Path) -> list[str]:
    """Remove the unfinished checkpoints under `root` (`.tmp` directories, `step_N/` without COMMITTED);
    returns their names. Call it only while no process writes there (the run folder's lock)."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for d in sorted(root.iterdir()):
        if d.name.startswith("step_") and d.is_dir() and (d.name.endswith(".tmp") or not (d / COMMITTED).exists()):
            shutil.rmtree(d)
            removed.append(d.name)
    return removed


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace `path` with `text` in one step (temporary file, fsync, rename): a crash leaves the old file or
    the new one, never a truncated one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(root: str | Path, step: int, state_dict: dict[str, torch.Tensor], train_state: dict[str, Any],
                    extra_files: dict[str, Path | str] | None = None, extra_dirs: dict[str, Path] | None = None,
                    keep: int = 3) -> Path:
    """Atomically write checkpoint `step` under `root`; returns its directory.

    state_dict: model tensors (saved with safetensors); train_state: anything torch.save can pickle with
    weights_only loading (tensors, numbers, strings, lists, dicts); extra_files: name -> source path or
    text content; extra_dirs: name -> directory copied in.
    """
    tmp = new_checkpoint_dir(root, step)
    write_model(tmp, state_dict)
    write_train_state(tmp, train_state, extra_files, extra_dirs)
    return commit_checkpoint(root, step, tmp, keep)


def write_model(tmp: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """model.safetensors of a checkpoint being written in `tmp` (tensors copied to the host)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    save_file(tensors, str(tmp / "model.safetensors"))


def read_model(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's model.safetensors (on the host), without verifying the manifest."""
    return load_file(str(Path(path) / "model.safetensors"))


def write_train_state(tmp: Path, train_state: dict[str, Any], extra_files: dict[str, Path | str] | None = None,
                      extra_dirs: dict[str, Path] | None = None) -> None:
    """train_state.pt plus the extra files and directories of a checkpoint being written in `tmp`."""
    with open(tmp / "train_state.pt", "wb") as f:
        stream = _RecordingWriter(f)
        try:
            torch.save(train_state, stream)
        except RuntimeError as e:
            # torch's C++ writer reports a failed write as "unexpected pos"; raise the OSError behind it
            if stream.error is not None:
                raise stream.error from e
            raise
    for name, source in (extra_files or {}).items():
        if isinstance(source, Path):
            shutil.copyfile(source, tmp / name)
        else:
            (tmp / name).write_text(source)
    for name, source in (extra_dirs or {}).items():
        shutil.copytree(source, tmp / name)


class _RecordingWriter:
    """A file for torch.save that keeps the OSError of a failed write (torch replaces it with its own error)."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def new_checkpoint_dir(root: str | Path, step: int) -> Path:
    """An empty `<root>/step_N.tmp` to write checkpoint `step` into before `commit_checkpoint`. An unfinished
    `step_N/` (no COMMITTED) is replaced; a committed one is never overwritten."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    if final.exists() and (final / COMMITTED).exists():
        raise CheckpointError(f"{final} already exists; refusing to overwrite a checkpoint")
    if final.exists():
        shutil.rmtree(final)
    tmp = root / (final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit_checkpoint(root: str | Path, step: int, tmp: Path, keep: int = 3) -> Path:
    """Seal a fully written `tmp` directory: manifest of sizes and SHA-256, COMMITTED marker, fsync, atomic
    rename to `step_N`, prune to the newest `keep`. Used for single-file and distributed (DCP) checkpoints."""
    root = Path(root)
    final = root / step_dir_name(step)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=1))
    for p in files + [tmp / MANIFEST]:
        _fsync_file(p)
    (tmp / COMMITTED).write_text(str(step))
    _fsync_file(tmp / COMMITTED)
    fsync_dir(tmp)
    os.replace(tmp, final)
    fsync_dir(root)
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    for stale in root.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    committed = committed_checkpoints(root)
    for old in committed[: max(0, len(committed) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(path: str | Path) -> dict:
    """Check COMMITTED and every file's size and hash; returns the manifest. Raises CheckpointError."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    if not (path / COMMITTED).exists():
        raise CheckpointError(f"{path} is a partial checkpoint (no {COMMITTED} marker); it was never finished")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable {MANIFEST}: {e}") from e
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{path}: {name} is missing")
        if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{path}: {name} is corrupted (size or SHA-256 differs from the manifest)")
    return manifest


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Verify, then load (model tensors, train_state). Raises CheckpointError on any problem."""
    path = Path(path)
    verify_checkpoint(path)
    tensors = read_model(path)
    train_state = torch.load(path / "train_state.pt", weights_only=True)
    return tensors, train_state


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder itself, or the newest committed checkpoint of a run folder. Raises CheckpointError."""
    root = Path(path)
    if (root / "model.safetensors").exists():
        return root
    ckpt = latest_checkpoint(root / "checkpoints")
    if ckpt is None:
        raise CheckpointError(f"{root} is neither a checkpoint folder (model.safetensors) nor a run folder with a "
                              "committed checkpoint under checkpoints/")
    return ckpt


def load_trained(path: str | Path, device: str | torch.device = "cpu", runtime: dict | None = None):
    """(model in eval mode, tokenizer, checkpoint folder) from a run folder (its newest committed checkpoint)
    or a checkpoint folder. Every front end that loads trained weights (generate, serve, chat, convert) uses this.
    A checkpoint with vision tensors loads as a `k3.vision.model.K3VisionLanguageModel`. `runtime`: runtime switches to run it with (`kda_impl`, …; never stored), e.g. the GPU kernels for serving."""
    from k3.config import ModelConfig
    from k3.model.model import K3ForCausalLM
    from k3.tokenizer import Tokenizer

    ckpt = resolve_checkpoint(path)
    tensors, _ = load_checkpoint(ckpt)
    config = ModelConfig.load(ckpt / "config.json").replace(**(runtime or {}))
    model_class = K3ForCausalLM
    if any(name.startswith(("vision_tower.", "mm_projector.")) for name in tensors):
        # a multimodal run: the tower and projector are saved under their release names (docs/vision.md)
        from k3.vision.model import K3VisionLanguageModel as model_class
    with torch.device("meta"):
        model = model_class(config)
    # assign: the model takes the loaded tensors without a second copy (every buffer is persistent)
    model.load_state_dict(tensors, assign=True)
    return model.to(device).eval(), Tokenizer.load(ckpt / "tokenizer"), ckpt
