"""`k3 train-draft`: the speculative draft's training run (docs/speculative.md; K3 report §4.1.4, §5.4.2).

One optimizer step:
1. draw a packed batch (rows of `seq_len` tokens with `cu_seqlens`, as `k3 train` cuts them);
2. the frozen target runs once in inference mode: its AttnRes block features, p at temperature 1, embeddings;
3. the draft's training-time test unrolls `unroll_steps` steps (`k3.spec.draft.unrolled_loss`); the loss is the mean
   L_LK over every valid (position, step) pair, with no cross-entropy term; backward reaches only the draft;
4. clip the gradient norm, skip the update if the loss or the norm is not finite; Per-Head Muon / AdamW step,
   cosine schedule; Quantile Balancing of the draft's router from all unrolled steps' routes.
Evaluation runs the same test on held-out text and reports the expected acceptance Σ_x min(p, q) of each unrolled
step; the first evaluation is of the untrained draft (step 0), so every run shows before and after.

The loop is its own (as `k3 rl`'s is), on the shared pieces: `k3 train`'s loop trains every parameter of a
`K3ForCausalLM` on a cross-entropy with QK-Clip and balancing for every layer, none of which fits a frozen target
with one trainable block and a loss over two models. Shared: the run folder's lock, stop signals and one-line
failures (`k3.runfolder`), atomic checkpoints (`k3.checkpoint`), tokenized corpora and packed batches
(`k3.train.data`, prepared by `k3.train.loop.prepare_data` for `--data`), the metrics log and its plots
(`k3.train.metrics`), the optimizer and schedule (`k3.optim`), the router's balancing (`k3.model.quantile_balancing`)
and, for target-generated text, the plain generation loop (`k3.infer.generate`). Nothing random is drawn while
training (the batches are a deterministic function of their position), so a resume continues exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3.checkpoint import (CheckpointError, clean_uncommitted, commit_checkpoint, latest_checkpoint, load_trained,
                           new_checkpoint_dir, read_model, resolve_checkpoint, step_dir_name, verify_checkpoint,
                           write_model, write_text_atomic, write_train_state)
from k3.config import ModelConfig
from k3.infer.api import SamplingParams
from k3.infer.generate import generate_steps
from k3.model.model import Collector, K3ForCausalLM
from k3.model.quantile_balancing import QuantileHistogram, expert_loads, imbalance_from_stats, layer_load_stats
from k3.optim import MuonAdamW, cosine_schedule
from k3.runfolder import (LOCK_FILE, DiskFull, RunError, RunFolder, RunLock, StopSignals, check_writable_folder,
                          disk_full)
from k3.spec.draft import Draft, build_draft, tokens_per_verify, unrolled_loss
from k3.tokenizer import Tokenizer
from k3.train.config import ContextStage, TrainConfig
from k3.train.data import PackedBatches, TokenizedCorpus, document_permutation, prepare_corpus
from k3.train.loop import autocast_context, ns_dtype_for, prepare_data
from k3.train.metrics import MetricsLog, plot_run
from k3.train.run_info import git_state
from k3.train.runtime import resolve_device

DEFAULT_STEPS = 200  # when neither max_steps nor time_budget_min is given
# The draft's input side is not in MuonAdamW's name table (the backbone's): routed here, as k3.vision.optim routes
# the tower. The two projections are whole-matrix Muon, the two norm gains AdamW.
INPUT_MUON = ("fc.weight", "eh_proj.weight")
INPUT_ADAMW = ("enorm.weight", "hnorm.weight")


@dataclass
class DraftTrainConfig:
    init_from: str = ""  # --from: the target's run folder (its newest checkpoint) or a checkpoint folder
    out: str = "runs/draft"
    # None: the target run's own tokenized corpus (data/train, data/heldout beside its checkpoints); else documents
    # (a file or folder, as `k3 train --data` reads them) tokenized with the target's tokenizer
    data: str | None = None
    # where p is computed: "corpus" (the training text) or "generated" (continuations the target samples at
    # `generated_temperature` (1; 0: greedy, the text a greedy engine writes) from the first `prompt_tokens` tokens
    # of `generated_documents` training documents)
    text: str = "corpus"
    generated_documents: int = 256
    generated_temperature: float = 1.0
    prompt_tokens: int = 16
    unroll_steps: int = 7
    seq_len: int = 256
    tokens_per_step: int = 2048
    max_steps: int | None = None  # neither this nor time_budget_min: DEFAULT_STEPS
    time_budget_min: float | None = None
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    qb_bins: int = 1000
    eval_every: int = 25
    eval_tokens: int = 8192
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    max_bad_steps: int = 5
    heldout_fraction: float = 0.02  # with --data
    data_streams: int = 16
    seed: int = 0
    device: str = "auto"
    muon_ns_dtype: str = "auto"
    optimizer_impl: str = "auto"

    def validate(self) -> None:
        """Raise ValueError for settings that cannot run; nothing is written before this."""
        if not self.init_from:
            raise ValueError("--from is required: the target's run folder or checkpoint")
        for name in ("generated_documents", "prompt_tokens", "unroll_steps", "seq_len", "tokens_per_step",
                     "max_steps", "qb_bins", "eval_every", "eval_tokens", "checkpoint_every", "keep_checkpoints",
                     "max_bad_steps", "data_streams"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("lr", "grad_clip", "time_budget_min"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if self.max_steps is not None and self.time_budget_min is not None:
            raise ValueError("give max_steps or time_budget_min, not both")
        if not (math.isfinite(self.generated_temperature) and self.generated_temperature >= 0):
            raise ValueError(f"generated_temperature must be >= 0, got {self.generated_temperature!r}")
        if self.text not in ("corpus", "generated"):
            raise ValueError(f"text must be corpus or generated, got {self.text!r}")
        if self.seq_len < self.unroll_steps + 2:
            raise ValueError(f"seq_len ({self.seq_len}) must exceed unroll_steps + 1 ({self.unroll_steps + 1})")
        if self.text == "generated" and self.prompt_tokens >= self.seq_len:
            raise ValueError(f"prompt_tokens ({self.prompt_tokens}) must be shorter than seq_len ({self.seq_len})")
        if self.tokens_per_step % self.seq_len:
            raise ValueError(f"tokens_per_step ({self.tokens_per_step}) must be a multiple of seq_len "
                             f"({self.seq_len})")
        if not 0 <= self.warmup_frac < 1 or not 0 <= self.min_lr_ratio <= 1 or self.weight_decay < 0:
            raise ValueError("warmup_frac must be in [0, 1), min_lr_ratio in [0, 1] and weight_decay >= 0")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.data is not None and not Path(self.data).exists():
            raise ValueError(f"data path {self.data!r} does not exist")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftTrainConfig:
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown draft training settings: {sorted(unknown)}")
        return cls(**data)


# Settings a resume may change: where things are, the cadence, and the length (the schedule follows a new length).
RESUMABLE = {"init_from", "out", "data", "max_steps", "time_budget_min", "eval_every", "checkpoint_every",
             "keep_checkpoints", "max_bad_steps", "device", "optimizer_impl"}
# What a start writes before run.json: a folder holding only these is a start that never finished.
STARTING_ENTRIES = {LOCK_FILE, "tokenizer", "tokenizer.tmp", "data", "config.json", "git.diff", "run.json.tmp"}


@dataclass
class DraftRun:
    """A draft training run between two steps: what a checkpoint saves and a resume restores."""

    cfg: DraftTrainConfig
    out: Path
    device: torch.device
    target: K3ForCausalLM
    draft: Draft
    optimizer: MuonAdamW
    scheduler: Any
    total_steps: int
    train_corpus: TokenizedCorpus
    heldout_corpus: TokenizedCorpus
    batches: PackedBatches
    metrics_log: MetricsLog
    info: dict[str, Any]  # draft.json: what the checkpoint's weights belong to
    step: int = 0
    tokens: int = 0
    bad_steps: int = 0
    last_checkpoint: Path | None = None
    last_eval: dict[str, Any] | None = None


@dataclass
class DraftSummary:
    out: Path
    steps: int
    start_step: int
    total_steps: int
    seconds: float
    checkpoint: Path | None
    before: dict[str, Any] | None  # the held-out evaluation of the untrained draft (step 0)
    after: dict[str, Any] | None  # the last held-out evaluation
    stopped: str | None = None


def train_draft(cfg: DraftTrainConfig, resume: bool = False, log=print, progress: bool = True,
                stop: StopSignals | None = None) -> DraftSummary:
    """Run (or resume) a draft's training as configured; returns a summary. `resume` continues the run in `cfg.out`
    (refused if there is none); without it a folder holding a run is refused. SIGINT/SIGTERM stop at the next step
    with a checkpoint and plots (`DraftSummary.stopped`). Raises ValueError for bad settings before anything is
    written, `k3.runfolder.RunError` when the run diverges, `k3.runfolder.DiskFull` when a checkpoint does not fit."""
    cfg.validate()
    check_writable_folder(cfg.out)
    out = Path(cfg.out)
    device = resolve_device(cfg.device)
    from tqdm.auto import tqdm

    with stop if stop is not None else StopSignals() as stop:
        RunLock(out).check_free()
        cfg, fresh = _check_out(out, cfg, resume)
        with RunFolder(out, log) as folder:
            if fresh:
                for p in sorted(out.iterdir()):  # a start that never finished is begun again
                    if p.is_dir():
                        shutil.rmtree(p)
                    elif p.name != LOCK_FILE:
                        p.unlink()
            started = time.perf_counter()
            run = _start(cfg, out, device, fresh, log, progress)
            folder.started()
            if not fresh:
                _resume(run, log)
            start_step = run.step
            if run.step == 0:
                run.metrics_log.write({"kind": "event", "step": 0, "event": "start", "total_steps": run.total_steps,
                                       "train_tokens": run.train_corpus.num_tokens,
                                       "heldout_tokens": run.heldout_corpus.num_tokens,
                                       "params": sum(p.numel() for p in run.draft.parameters())})
                _evaluate(run)  # the untrained draft: where the acceptance starts
            stopping = 0
            bar = tqdm(total=run.total_steps, initial=run.step, desc="train-draft", unit="step", disable=not progress,
                       dynamic_ncols=True)
            since = time.perf_counter()
            try:
                with stop.at_boundaries():
                    while run.step < run.total_steps and not stopping:
                        record = _step(run, since, log)
                        stopping = stop.signum or 0
                        if run.step % cfg.eval_every == 0 or run.step == run.total_steps:
                            _evaluate(run)
                        if run.step % cfg.checkpoint_every == 0 or run.step == run.total_steps or stopping:
                            _checkpoint(run)
                        acc = record["acceptance"]
                        bar.set_postfix(loss=f"{record['loss']:.3f}", acc1=f"{acc[0]:.2f}",
                                        accK=f"{acc[-1]:.2f}", lr=f"{record['lr']:.1e}")
                        bar.update(1)
                        since = time.perf_counter()
                    if run.step == start_step:
                        plot_draft(out / "metrics.jsonl", out / "plots")
            except RunError:
                plot_draft(out / "metrics.jsonl", out / "plots")
                raise
            finally:
                bar.close()
    evals = [r for r in run.metrics_log.read() if r.get("kind") == "eval"]
    stopped = signal.Signals(stopping).name if stopping and run.step < run.total_steps else None
    return DraftSummary(out, run.step, start_step, run.total_steps, time.perf_counter() - started,
                        run.last_checkpoint, evals[0] if evals else None, evals[-1] if evals else None, stopped)


# ------------------------------------------------------------------------------------------------------ one step


def build_optimizer(draft: Draft, cfg: DraftTrainConfig, device: torch.device) -> MuonAdamW:
    """Per-Head Muon / AdamW over the draft: its block by the backbone layer names it carries
    (`model.layers.{L}.…`), its input side (`INPUT_MUON`, `INPUT_ADAMW`) in two groups of its own."""
    own = set(INPUT_MUON) | set(INPUT_ADAMW)
    block = [(f"model.layers.{draft.layer_idx}.{n}", p) for n, p in draft.named_parameters() if n not in own]
    optimizer = MuonAdamW(block, draft.config, lr=cfg.lr, weight_decay=cfg.weight_decay,
                          ns_dtype=ns_dtype_for(cfg.muon_ns_dtype, device), impl=cfg.optimizer_impl)
    params = dict(draft.named_parameters())
    for kind, names in (("muon", INPUT_MUON), ("adamw", INPUT_ADAMW)):
        optimizer.add_param_group({"params": [params[n] for n in names], "param_names": list(names), "kind": kind})
        if kind == "muon":
            for n in names:
                optimizer.block_shapes[params[n]] = (1, *params[n].shape)
    return optimizer


def train_step(draft: Draft, target: K3ForCausalLM, optimizer, scheduler, batch, cfg: DraftTrainConfig,
               device: torch.device) -> dict[str, Any]:
    """One optimizer step of the draft on one packed batch (module docstring). Returns the step's metrics; a step
    with a non-finite loss or gradient norm changes nothing (`skipped`)."""
    draft.train()
    moe = draft.block_sparse_moe
    bias = moe.gate.e_score_correction_bias
    histogram = QuantileHistogram(bias, cfg.qb_bins, fused=moe.gate.fast(bias))
    infos = Collector()
    with autocast_context(device):
        result = unrolled_loss(draft, target, batch.input_ids, batch.labels, batch.cu_seqlens, cfg.unroll_steps,
                               infos)
    count = result.counts.sum()
    (result.loss / count.clamp(min=1)).backward()
    loads = torch.zeros(bias.numel(), dtype=torch.int64, device=bias.device)
    for info, mask in zip(infos, result.token_masks):  # one route per unrolled step
        histogram.add(info.scores, info.cutoff, mask)
        loads += expert_loads(info.topk_idx, loads.numel(), mask)
    grad_norm = torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
    K = cfg.unroll_steps
    # everything the host needs from the step in one read
    values = torch.cat([result.loss_sums.double(), result.acceptance_sums.double(), result.counts.double(),
                        grad_norm.double().reshape(1), layer_load_stats(loads[None]).reshape(-1),
                        histogram.counts[0].sum().double().reshape(1)]).tolist()
    loss_sums, acceptance_sums, counts = values[:K], values[K:2 * K], values[2 * K:3 * K]
    grad_norm, load_mean, load_max, routed = values[3 * K:]
    total = max(sum(counts), 1.0)
    metrics: dict[str, Any] = {"loss": sum(loss_sums) / total, "grad_norm": grad_norm,
                               "lr": optimizer.param_groups[0]["lr"], "tokens": batch.num_tokens,
                               "acceptance": [a / max(c, 1.0) for a, c in zip(acceptance_sums, counts)],
                               "positions": [int(c) for c in counts]}
    if not (math.isfinite(metrics["loss"]) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        metrics["skipped"] = True
        return metrics
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    if routed:
        with torch.no_grad():
            bias.copy_(histogram.bias(moe.top_k, num_tokens=round(routed)))
        metrics["moe_max_over_mean"] = imbalance_from_stats([load_mean], [load_max])["max_over_mean"]
    return metrics


@torch.no_grad()
def evaluate(draft: Draft, target: K3ForCausalLM, corpus: TokenizedCorpus, cfg: DraftTrainConfig,
             device: torch.device) -> dict[str, Any]:
    """The training-time test on held-out text (router biases frozen): mean L_LK, the expected acceptance
    Σ_x min(p, q) of each unrolled step, and the tokens per verification they imply (`tokens_per_verify`)."""
    draft.eval()
    rows = max(1, min(8, cfg.eval_tokens // cfg.seq_len))
    K = cfg.unroll_steps
    loss_sums, acceptance_sums, counts = torch.zeros(K, dtype=torch.float64), torch.zeros(K, dtype=torch.float64), \
        torch.zeros(K, dtype=torch.float64)
    tokens = 0
    for batch in PackedBatches.eval(corpus, rows, cfg.seq_len):
        with autocast_context(device):
            result = unrolled_loss(draft, target, batch.input_ids, batch.labels, batch.cu_seqlens, K)
        loss_sums += result.loss_sums.double().cpu()
        acceptance_sums += result.acceptance_sums.double().cpu()
        counts += result.counts.double().cpu()
        tokens += batch.num_tokens
        if tokens >= cfg.eval_tokens:
            break
    acceptance = (acceptance_sums / counts.clamp(min=1)).tolist()
    return {"loss": float(loss_sums.sum() / counts.sum().clamp(min=1)), "acceptance": acceptance,
            "tokens_per_verify": tokens_per_verify(acceptance), "tokens": tokens}


def _step(run: DraftRun, since: float, log) -> dict[str, Any]:
    metrics = train_step(run.draft, run.target, run.optimizer, run.scheduler, next(run.batches), run.cfg, run.device)
    run.step += 1
    run.tokens += metrics["tokens"]
    record = {"kind": "train", "step": run.step, "tokens_seen": run.tokens, **metrics}
    if metrics.get("skipped"):
        run.bad_steps += 1
        log(f"step {run.step}: non-finite loss or gradient norm (loss {metrics['loss']}, grad norm "
            f"{metrics['grad_norm']}); update skipped ({run.bad_steps} in a row)")
        if run.bad_steps >= run.cfg.max_bad_steps:
            run.metrics_log.write(record)
            raise RunError(f"{run.bad_steps} non-finite steps in a row at step {run.step}; stopping. The last good "
                           f"checkpoint is {run.last_checkpoint or 'not written yet'}")
    else:
        run.bad_steps = 0
    record["tokens_per_s"] = metrics["tokens"] / max(time.perf_counter() - since, 1e-9)
    run.metrics_log.write(record)
    return record


def _evaluate(run: DraftRun) -> None:
    run.last_eval = evaluate(run.draft, run.target, run.heldout_corpus, run.cfg, run.device)
    run.metrics_log.write({"kind": "eval", "step": run.step, **run.last_eval})


# --------------------------------------------------------------------------------------------------------- setting up


def _check_out(out: Path, cfg: DraftTrainConfig, resume: bool) -> tuple[DraftTrainConfig, bool]:
    """(settings, fresh). Refuses a folder holding something else, a second start over a run, a resume of nothing,
    and a resume with other settings than `RESUMABLE`. A resume keeps the run's length unless one is given. Reads
    only."""
    if (out / "run.json").exists():
        if not resume:
            raise ValueError(f"{out} already holds a draft training run; pass --resume to continue it, or choose "
                             f"another --out")
        try:
            stored = DraftTrainConfig.from_dict(json.loads((out / "run.json").read_text())["draft_config"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{out / 'run.json'} is not a draft training run's ({e}); choose another --out") from e
        new, old = cfg.as_dict(), stored.as_dict()
        differing = sorted(k for k in new if new[k] != old[k] and k not in RESUMABLE)
        if differing:
            raise ValueError(f"{out} holds a run with different settings ({', '.join(differing)}); resume it with "
                             f"its own settings or choose another --out")
        if cfg.time_budget_min is not None and cfg.time_budget_min != stored.time_budget_min:
            raise ValueError("a resume sets a new length with --max-steps, not --time-budget")
        keep = {k: new[k] for k in RESUMABLE - {"init_from", "data", "max_steps", "time_budget_min"}}
        if cfg.max_steps is not None:
            keep["max_steps"] = cfg.max_steps
        return dataclasses.replace(stored, **keep), False
    if resume:
        raise ValueError(f"there is no draft training run to resume in {out}; start one without --resume")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not set(entries) <= STARTING_ENTRIES:
        raise ValueError(f"{out} exists and is not a k3 draft training run (it holds {', '.join(entries[:4])}); "
                         f"choose another --out")
    return cfg, True


def _target_sha(checkpoint: Path) -> str:
    return json.loads((checkpoint / "manifest.json").read_text())["files"]["model.safetensors"]["sha256"]


def _load_target(cfg: DraftTrainConfig, out: Path, fresh: bool, device: torch.device) -> tuple[K3ForCausalLM, Any,
                                                                                                Path, str]:
    """(target frozen in eval mode, its tokenizer, its checkpoint folder, the SHA-256 of its weights). A resumed run
    reloads the checkpoint it started from, and refuses a `--from` that names other weights."""
    if fresh:
        ckpt = resolve_checkpoint(cfg.init_from).resolve()
    else:
        info = json.loads((out / "run.json").read_text())
        ckpt = Path(info["target_checkpoint"])
        if not ckpt.is_dir():
            raise CheckpointError(f"the target checkpoint this draft was trained against, {ckpt}, is gone")
        if cfg.init_from and _target_sha(resolve_checkpoint(cfg.init_from)) != info["target_sha256"]:
            raise ValueError(f"--from {cfg.init_from} holds other weights than the target this run started from "
                             f"({ckpt})")
    target, tokenizer, ckpt = load_trained(ckpt, device)
    if device.type == "cuda":
        target.cast(torch.bfloat16)
    target.requires_grad_(False)
    return target.eval(), tokenizer, ckpt, _target_sha(ckpt)


def _corpora(cfg: DraftTrainConfig, out: Path, fresh: bool, target: K3ForCausalLM, tokenizer: Tokenizer,
             ckpt: Path, log, progress: bool) -> tuple[TokenizedCorpus, TokenizedCorpus]:
    """(training corpus, held-out corpus): the target run's own, or `--data` tokenized into `out/data`; with
    `text="generated"` the training corpus is the target's continuations (`out/data/generated`, made once)."""
    if cfg.data is not None and not fresh:  # prepared when the run started
        train, heldout = TokenizedCorpus.open(out / "data" / "train"), TokenizedCorpus.open(out / "data" / "heldout")
    elif cfg.data is not None:
        as_train = TrainConfig(data=cfg.data, init_from=str(ckpt), heldout_fraction=cfg.heldout_fraction,
                               seed=cfg.seed, stages=[ContextStage(cfg.seq_len, 1.0)],
                               tokens_per_step=cfg.tokens_per_step)
        _, train, heldout = prepare_data(as_train, tokenizer.vocab_size, out, log)
    else:
        data = ckpt.parent.parent / "data"
        if not (data / "train" / "meta.json").is_file() or not (data / "heldout" / "meta.json").is_file():
            raise ValueError(f"{ckpt} has no tokenized corpus beside it ({data}/train, heldout); pass --data")
        train, heldout = TokenizedCorpus.open(data / "train"), TokenizedCorpus.open(data / "heldout")
        if train.meta.get("tokenizer") != tokenizer.fingerprint():
            raise ValueError(f"{data} was tokenized with another tokenizer than the target's; pass --data")
    if cfg.text == "generated":
        generated = out / "data" / "generated"
        if fresh or not (generated / "meta.json").is_file():
            sequences = generate_documents(target, train, tokenizer, cfg, log, progress)
            prepare_corpus([str(i) for i in range(len(sequences))], tokenizer, generated, show_progress=False,
                           source=GeneratedDocuments(sequences))
        train = TokenizedCorpus.open(generated)
    return train, heldout


class GeneratedDocuments:
    """Token sequences the target wrote, as a `prepare_corpus` data source: document i is sequence i, stored as its
    ids (no detokenize-and-retokenize round trip, which need not give the same ids back)."""

    format = "generated"
    whole_documents = False

    def __init__(self, sequences: list[list[int]]):
        self.sequences = sequences

    def documents(self) -> list[tuple[str, str]]:
        return [(str(i), str(i)) for i in range(len(self.sequences))]

    def encode(self, tokenizer, texts) -> list[tuple[list[int], None]]:
        return [(self.sequences[int(t)], None) for t in texts]


@torch.no_grad()
def generate_documents(target: K3ForCausalLM, corpus: TokenizedCorpus, tokenizer: Tokenizer, cfg: DraftTrainConfig,
                       log, progress: bool = True, batch_size: int = 16) -> list[list[int]]:
    """`cfg.generated_documents` sequences of up to `cfg.seq_len` tokens: the first `cfg.prompt_tokens` tokens of
    training documents (in the seeded shuffle's order, those long enough) and what the target samples after them at
    `cfg.generated_temperature` (0: its argmax), up to and including a stop token. Seeded: the same settings write
    the same sequences."""
    from tqdm.auto import tqdm

    P = cfg.prompt_tokens
    order = document_permutation(corpus.num_documents, cfg.seed, 0)
    prompts = [corpus.document(int(i))[:P].astype(np.int64) for i in order if corpus.offsets[i + 1] -
               corpus.offsets[i] >= P][: cfg.generated_documents]
    if not prompts:
        raise ValueError(f"no training document has the {P} prompt tokens to generate from")
    params = SamplingParams(max_tokens=cfg.seq_len - P, temperature=cfg.generated_temperature,
                            stop_token_ids=tuple(tokenizer.stop_ids))
    device = next(target.parameters()).device
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    log(f"generating {len(prompts)} sequences of up to {cfg.seq_len} tokens with the target")
    sequences = []
    with tqdm(total=len(prompts), desc="generating", unit="seq", disable=not progress) as bar:
        for start in range(0, len(prompts), batch_size):
            batch = torch.from_numpy(np.stack(prompts[start:start + batch_size]))
            rows = [list(map(int, p)) for p in batch]
            done = [False] * len(rows)
            for step in generate_steps(target, batch, params, generator, pad_id=tokenizer.pad_id):
                for b, (token, stopped) in enumerate(zip(step.tokens.tolist(), step.stopped.tolist())):
                    if not done[b]:
                        rows[b].append(token)
                        done[b] = stopped
            sequences += rows
            bar.update(len(rows))
    return sequences


def _start(cfg: DraftTrainConfig, out: Path, device: torch.device, fresh: bool, log, progress: bool) -> DraftRun:
    """The frozen target, the data, the draft with its optimizer and schedule; a fresh run's run.json (written
    last: its presence means the run exists)."""
    torch.manual_seed(cfg.seed)
    target, tokenizer, ckpt, sha = _load_target(cfg, out, fresh, device)
    train_corpus, heldout_corpus = _corpora(cfg, out, fresh, target, tokenizer, ckpt, log, progress)
    batches = PackedBatches(train_corpus, cfg.tokens_per_step // cfg.seq_len, cfg.seq_len, seed=cfg.seed,
                            streams=cfg.data_streams)
    draft = build_draft(target.config, seed=cfg.seed, device=device)
    optimizer = build_optimizer(draft, cfg, device)
    info = {"target_checkpoint": str(ckpt), "target_sha256": sha, "layer_idx": draft.layer_idx,
            "feature_blocks": list(draft.feature_blocks), "unroll_steps": cfg.unroll_steps}
    if fresh:
        total_steps = cfg.max_steps or (DEFAULT_STEPS if cfg.time_budget_min is None else
                                        _budget_steps(cfg, draft, target, batches, device, log))
        target.config.save(out / "config.json")
        if not (out / "tokenizer").exists():
            shutil.copytree(ckpt / "tokenizer", out / "tokenizer")
        git = git_state()
        (out / "git.diff").write_text(git["diff"])
        run_info = {"draft_config": dataclasses.replace(cfg, init_from=str(ckpt)).as_dict(),
                    "total_steps": total_steps, "target_checkpoint": str(ckpt), "target_sha256": sha,
                    "git_revision": git["revision"], "torch": torch.__version__}
        write_text_atomic(out / "run.json", json.dumps(run_info, indent=2))
    else:
        run_info = json.loads((out / "run.json").read_text())
        total_steps = cfg.max_steps or run_info["total_steps"]
        if total_steps != run_info["total_steps"]:
            ckpt_at = latest_checkpoint(out / "checkpoints")
            at = int(ckpt_at.name.split("_")[1]) if ckpt_at is not None else 0
            if total_steps < at:
                raise ValueError(f"{out} has a checkpoint at step {at}; a length of {total_steps} steps would end "
                                 f"before it (pass a larger --max-steps)")
            run_info["total_steps"] = total_steps
            run_info["draft_config"]["max_steps"] = total_steps
            write_text_atomic(out / "run.json", json.dumps(run_info, indent=2))
            log(f"the run's length is now {total_steps} steps")
    scheduler = cosine_schedule(optimizer, total_steps, cfg.warmup_frac, cfg.min_lr_ratio)
    return DraftRun(cfg, out, device, target, draft, optimizer, scheduler, total_steps, train_corpus,
                    heldout_corpus, batches, MetricsLog(out / "metrics.jsonl"), info)


def _budget_steps(cfg: DraftTrainConfig, draft: Draft, target: K3ForCausalLM, batches: PackedBatches,
                  device: torch.device, log) -> int:
    """Steps that fit `cfg.time_budget_min` on this machine: the faster of two warm steps of a throwaway copy of the
    draft, on a throwaway copy of the batches; 15% of the budget is left to evaluations and checkpoints."""
    probe = copy.deepcopy(draft)
    optimizer = build_optimizer(probe, cfg, device)
    scheduler = cosine_schedule(optimizer, 10)
    batch = next(PackedBatches(batches.corpus, batches.batch_size, batches.seq_len, seed=cfg.seed,
                               streams=cfg.data_streams))
    train_step(probe, target, optimizer, scheduler, batch, cfg, device)
    timings = []
    for _ in range(2):
        start = time.perf_counter()
        train_step(probe, target, optimizer, scheduler, batch, cfg, device)
        timings.append(time.perf_counter() - start)
    total = max(1, int(cfg.time_budget_min * 60 * 0.85 / min(timings)))
    log(f"time budget {cfg.time_budget_min:g} min at ~{min(timings):.2f} s/step → {total} steps")
    return total


# -------------------------------------------------------------------------------------------------------- checkpoints


def _checkpoint(run: DraftRun) -> None:
    """Save the run (unless this step is saved already) and redraw the plots."""
    if run.last_checkpoint is None or run.last_checkpoint.name != step_dir_name(run.step):
        run.last_checkpoint = save(run)
    plot_draft(run.out / "metrics.jsonl", run.out / "plots")


def save(run: DraftRun) -> Path:
    """Checkpoint the run at its step: the draft's weights (model.safetensors), optimizer, schedule, data position,
    step and token counts (train_state.pt), the target's config.json and draft.json (what the weights belong to)."""
    root, step = run.out / "checkpoints", run.step
    tmp = new_checkpoint_dir(root, step)
    try:
        write_model(tmp, run.draft.state_dict())
        state = {"optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(), "step": step,
                 "tokens": run.tokens, "data": run.batches.state_dict()}
        write_train_state(tmp, state, {"config.json": json.dumps(run.draft.config.to_config_json(), indent=2),
                                       "draft.json": json.dumps(run.info, indent=2)})
        return commit_checkpoint(root, step, tmp, run.cfg.keep_checkpoints)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if disk_full(e):
            raise DiskFull(f"no space left on device for the step-{step} checkpoint in {root}: the partial "
                           f"checkpoint was removed and the last good one ({run.last_checkpoint or 'none yet'}) "
                           f"kept; free some space, then resume") from e
        raise


def _resume(run: DraftRun, log) -> None:
    """The newest committed checkpoint into `run`; the metrics log is cut back to it (no checkpoint: the run
    starts over, its first evaluation included)."""
    removed = clean_uncommitted(run.out / "checkpoints")
    if removed:
        log(f"{run.out}: removed unfinished checkpoints {', '.join(removed)}")
    ckpt = latest_checkpoint(run.out / "checkpoints")
    if ckpt is None:
        run.metrics_log.truncate_after(-1)
        return
    try:
        verify_checkpoint(ckpt)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; to resume from the checkpoint before it, move {ckpt.name} out of "
                              f"{ckpt.parent}") from e
    state = torch.load(ckpt / "train_state.pt", weights_only=True)
    run.draft.load_state_dict({k: v.to(run.device) for k, v in read_model(ckpt).items()})
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    # the schedule follows the run's current length (a resume may give a new one)
    for multiplier in run.scheduler.lr_lambdas:
        multiplier.total_steps = run.total_steps
    for group, base in zip(run.optimizer.param_groups, run.scheduler.base_lrs):
        group["lr"] = base * run.scheduler.lr_lambdas[0](run.scheduler.last_epoch)
    run.batches.load_state_dict(state["data"])
    run.step, run.tokens, run.last_checkpoint = state["step"], state["tokens"], ckpt
    run.metrics_log.truncate_after(run.step)
    log(f"resumed from {ckpt} (step {run.step})")


def load_draft(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[Draft, dict[str, Any]]:
    """(draft in eval mode, draft.json) from a `k3 train-draft` run folder (its newest committed checkpoint) or a
    checkpoint folder, verified. draft.json names the target checkpoint and the SHA-256 of its weights."""
    ckpt = resolve_checkpoint(path)
    verify_checkpoint(ckpt)
    if not (ckpt / "draft.json").is_file():
        raise CheckpointError(f"{ckpt} is not a draft checkpoint (no draft.json)")
    info = json.loads((ckpt / "draft.json").read_text())
    with torch.device("meta"):
        draft = Draft(ModelConfig.load(ckpt / "config.json"))
    draft.load_state_dict(read_model(ckpt), assign=True)
    return draft.to(device).eval(), info


# -------------------------------------------------------------------------------------------------------------- plots


def plot_draft(metrics_path: Path, out_dir: Path, title: str = "k3 draft") -> list[Path]:
    """`k3 train`'s plots (L_LK as the loss, learning rate, gradient norm, router balance) plus acceptance.png: the
    held-out expected acceptance of every unrolled step over training, and per step before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = plot_run(metrics_path, out_dir, title=f"{title} (L_LK)")
    evals = [r for r in MetricsLog(metrics_path).read() if r.get("kind") == "eval"]
    if not evals:
        return paths
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in evals]
    K = len(evals[0]["acceptance"])
    for k in range(K):
        axes[0].plot(steps, [r["acceptance"][k] for r in evals], "o-", ms=3, lw=1, label=f"step {k + 1}")
    axes[0].set_xlabel("optimizer step")
    axes[0].set_ylabel("held-out Σ min(p, q)")
    axes[0].set_title(f"{title}: expected acceptance per unrolled step")
    axes[0].legend(fontsize=7, ncol=2)
    width = 0.4
    xs = np.arange(1, K + 1)
    axes[1].bar(xs - width / 2, evals[0]["acceptance"], width, label=f"step {evals[0]['step']}")
    axes[1].bar(xs + width / 2, evals[-1]["acceptance"], width, label=f"step {evals[-1]['step']}")
    axes[1].set_xlabel("unrolled step")
    axes[1].set_xticks(xs)
    axes[1].set_title(f"tokens per verify (k = {K}): {evals[0]['tokens_per_verify']:.2f} → "
                      f"{evals[-1]['tokens_per_verify']:.2f}")
    axes[1].legend()
    for a in axes:
        a.set_ylim(0, 1)
        a.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(out_dir) / "acceptance.png"
    tmp = path.with_name(path.name + ".tmp")
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return paths + [path]
