"""The training loop, top to bottom: data → model → Per-Head Muon/AdamW → QK-Clip → Quantile Balancing.

One optimizer step:
1. draw the step's micro-batches (packed rows with `cu_seqlens`; labels -100 at fragment ends);
2. for each: forward with router statistics and MLA max logits, loss = Σ token CE / (labelled tokens of
   the whole step), backward; add the router's required biases to each MoE layer's QB histogram;
3. clip the gradient norm; skip the update if the loss or the norm is not finite;
4. optimizer step, learning-rate step, QK-Clip with the step's per-head max logits;
5. Quantile Balancing: each MoE layer's bias becomes the histogram quantile, used from the next step.
Evaluation freezes the biases (no histogram). Checkpoints are atomic (`checkpoint.py`) and a resumed run
continues exactly: same data position, optimizer and scheduler state, RNG, biases and metrics log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3.config import ModelConfig, get_preset
from k3.parallel.muon import DistributedMuonAdamW
from k3.parallel.parallelize import DCP_MARKER, ParallelTraining, parallelize
from k3.parallel.runtime import ParallelRuntime
from k3.model.checkpointing import apply_activation_checkpointing
from k3.model.model import K3ForCausalLM, build_model
from k3.model.moe import StableLatentMoE
from k3.model.quantile_balancing import QuantileHistogram, expert_loads, imbalance_from_stats, layer_load_stats
from k3.ops.weight_grads import accumulating_weight_grads
from k3.optim import MuonAdamW, cosine_schedule, qk_clip_, qk_clip_stats
from k3.checkpoint import (CheckpointError, commit_checkpoint, latest_checkpoint, load_checkpoint,
                           new_checkpoint_dir, save_checkpoint, step_dir_name, verify_checkpoint,
                           write_train_state)
from k3.train.data import (PackedBatches, TokenizedCorpus, documents_fingerprint, prepare_corpus, read_documents,
                           split_documents, stdlib_documents)
from k3.train.metrics import MetricsLog, plot_run
from k3.tokenizer import Tokenizer, train_bpe


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. repeated non-finite losses); the last checkpoint is usable."""


@dataclass
class ContextStage:
    """Train at `seq_len` for this `fraction` of the optimizer steps (progressive context extension)."""

    seq_len: int
    fraction: float


@dataclass
class TrainConfig:
    preset: str = "tiny"
    data: str | None = None  # None: the running Python's standard library sources
    out: str = "runs/tiny"
    # batch: tokens per optimizer step = batch_rows × seq_len of the current stage (constant across stages)
    tokens_per_step: int = 2048
    micro_batches: int = 1  # gradient accumulation
    stages: list[ContextStage] = field(default_factory=lambda: [ContextStage(256, 0.8), ContextStage(512, 0.2)])
    data_streams: int = 16  # rows of a batch come from this many interleaved document streams (data.py)
    # length of the run: the first of these that is set
    max_steps: int | None = None
    max_tokens: int | None = None
    time_budget_min: float | None = None
    # optimizer (systems.md §1): one learning rate for Muon (RMS-matched) and AdamW
    lr: float = 6e-3
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.01
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    qk_clip_tau: float = 100.0
    # Newton–Schulz precision: "auto" = bf16 as in the K3 report on CUDA and on CPUs that multiply bf16 natively
    # (AVX512-BF16 / AMX: ~3× faster than fp32 there), fp32 on other CPUs (`ns_dtype_for`); or "bfloat16", "float32"
    muon_ns_dtype: str = "auto"
    # the optimizer step: "auto" = fused kernels on CUDA (docs/optimizer.md, "Fused step"), "reference" = foreach
    optimizer_impl: str = "auto"
    qb_bins: int = 1000
    # evaluation, checkpoints, logging
    eval_every: int = 50
    eval_tokens: int = 32768
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    log_every: int = 1
    max_bad_steps: int = 5
    seed: int = 0
    heldout_fraction: float = 0.02
    vocab_size: int | None = None  # default: the preset's
    device: str = "auto"
    # distributed (under torchrun; docs/distributed.md): FSDP2 over all ranks, with these on top
    context_parallel: int = 1  # ranks sharing each sequence (contiguous slices)
    expert_parallel: bool = False  # routed experts sharded over all ranks
    moonep: bool = True  # with expert_parallel: balance ranks exactly with the MoonEP planner
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (memory for time)

    def validate(self) -> None:
        if not self.stages:
            raise ValueError("at least one context stage is needed")
        if abs(sum(s.fraction for s in self.stages) - 1.0) > 1e-6:
            raise ValueError(f"stage fractions must sum to 1, got {[s.fraction for s in self.stages]}")
        for s in self.stages:
            if s.seq_len < 2 or self.tokens_per_step % (s.seq_len * self.micro_batches):
                raise ValueError(f"tokens_per_step ({self.tokens_per_step}) must be a multiple of seq_len × "
                                 f"micro_batches ({s.seq_len} × {self.micro_batches})")
        for name in ("max_steps", "max_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be positive, got {v}")
        if self.time_budget_min is not None and self.time_budget_min <= 0:
            raise ValueError("time_budget_min must be positive")
        if self.lr <= 0:
            raise ValueError("lr must be positive")
        if self.data_streams < 1:
            raise ValueError(f"data_streams must be >= 1, got {self.data_streams}")
        if self.context_parallel < 1:
            raise ValueError(f"context_parallel must be >= 1, got {self.context_parallel}")
        if self.muon_ns_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"muon_ns_dtype must be auto, bfloat16 or float32, got {self.muon_ns_dtype!r}")
        if self.optimizer_impl not in ("auto", "reference", "fused"):
            raise ValueError(f"optimizer_impl must be auto, reference or fused, got {self.optimizer_impl!r}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        data = dict(data)
        data["stages"] = [ContextStage(**s) for s in data["stages"]]
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown training settings: {sorted(unknown)}")
        return cls(**data)


# Settings that may differ between a run and its resumption (they do not change what is computed).
RESUMABLE_OVERRIDES = {"max_steps", "max_tokens", "time_budget_min", "eval_every", "checkpoint_every",
                       "keep_checkpoints", "log_every", "device", "max_bad_steps", "context_parallel",
                       "expert_parallel", "moonep", "activation_checkpointing", "optimizer_impl"}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def git_state() -> dict[str, str]:
    """The source revision and the diff of uncommitted changes, when running from a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        diff = subprocess.run(["git", "diff", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"revision": "unknown", "diff": ""}
    return {"revision": rev.stdout.strip() or "unknown", "diff": diff.stdout}


def prepare_data(cfg: TrainConfig, vocab_size: int, out: Path, log) -> tuple[Tokenizer, TokenizedCorpus,
                                                                               TokenizedCorpus]:
    """Tokenizer and tokenized train/held-out corpora under `out/`, reused when already built."""
    docs = stdlib_documents() if cfg.data is None else read_documents(cfg.data)
    if not docs:
        raise ValueError(f"no documents found in {cfg.data!r}")
    train_docs, heldout_docs = split_documents(docs, cfg.heldout_fraction, seed=cfg.seed)
    if not train_docs or not heldout_docs:
        raise ValueError(f"the data holds {len(docs)} document(s); at least 2 are needed for a held-out split")
    tok_dir = out / "tokenizer"
    if (tok_dir / "tokenizer.json").exists() or (tok_dir / "tiktoken.model").exists():
        tokenizer = Tokenizer.load(tok_dir)
    else:
        log(f"training a {vocab_size}-token byte-level BPE on {len(train_docs):,} documents")
        tokenizer = train_bpe((text for _, text in train_docs), vocab_size)
        tokenizer.save(tok_dir)
    corpora = []
    for split, split_docs in (("train", train_docs), ("heldout", heldout_docs)):
        directory = out / "data" / split
        fingerprint = documents_fingerprint(split_docs) + tokenizer.fingerprint()
        meta_path = directory / "meta.json"
        if not (meta_path.exists() and json.loads(meta_path.read_text()).get("run_fingerprint") == fingerprint):
            prepare_corpus(split_docs, tokenizer, directory)
            meta = json.loads(meta_path.read_text())
            meta["run_fingerprint"] = fingerprint
            meta_path.write_text(json.dumps(meta))
        corpora.append(TokenizedCorpus.open(directory))
    return tokenizer, corpora[0], corpora[1]


def moe_layers(model: K3ForCausalLM) -> list[StableLatentMoE]:
    return [layer.block_sparse_moe for layer in model.model.layers if layer.is_moe]


def ns_dtype_for(name: str, device: torch.device) -> torch.dtype:
    """`TrainConfig.muon_ns_dtype` on `device`. "auto": bf16 on CUDA and on CPUs whose oneDNN multiplies bf16
    natively, fp32 on the others, where bf16 matmuls take a slow generic path (an AVX2-only AMD EPYC, session 18:
    0.8 GFLOP/s in bf16 against 105 in fp32, which made the tiny preset's step ~10× slower)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.bfloat16 if native else torch.float32


def autocast_context(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(model: K3ForCausalLM, optimizer, scheduler, batches: list, cfg: TrainConfig,
               device: torch.device, parallel: ParallelTraining | None = None) -> dict[str, Any]:
    """One optimizer step over `batches` (micro-batches). Returns the step's metrics.

    Distributed (`parallel` set): every rank gets the same global micro-batches and keeps its piece;
    losses, QB histograms, expert loads and MLA max logits are reduced over all ranks, so the metrics
    and the update equal the single-process step on the global batch.
    """
    model.train()
    moes = moe_layers(model)
    histograms = [QuantileHistogram(m.gate.e_score_correction_bias, cfg.qb_bins,
                                    fused=m.gate.fast(m.gate.e_score_correction_bias)) for m in moes]
    loads = [torch.zeros(m.gate.e_score_correction_bias.numel(), dtype=torch.int64, device=device) for m in moes]
    max_logits = None
    total_tokens = sum(b.num_tokens for b in batches)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # stays on the device until the step's one read
    for batch in batches:
        if parallel is not None:  # cut on the host, move only this rank's piece
            input_ids, labels, cu_seqlens = parallel.shard(batch.input_ids, batch.labels, batch.cu_seqlens)
        else:  # host tensors: the model checks them there and copies them without waiting for the GPU
            input_ids, labels, cu_seqlens = batch.input_ids, batch.labels, batch.cu_seqlens
        with autocast_context(device):
            out = model(input_ids, cu_seqlens=cu_seqlens, return_router_infos=True, return_mla_max_logits=True,
                        labels=labels)
        loss = out.loss
        scale = parallel.loss_scale if parallel is not None else 1.0
        # one device: weight gradients added into .grad where they are computed (k3.ops.weight_grads); the
        # parallel wrappers own their parameters' gradients
        with accumulating_weight_grads(parallel is None):
            (loss * (scale / total_tokens)).backward()
        loss_sum += loss.detach().double()
        if len(out.router_infos) != len(moes):
            raise TrainingError(f"the forward reported {len(out.router_infos)} router statistics for "
                                f"{len(moes)} MoE layers (a wrapper dropped them)")
        for hist, layer_loads, info in zip(histograms, loads, out.router_infos):
            hist.add(info.scores, info.cutoff)
            layer_loads += expert_loads(info.topk_idx, layer_loads.numel())
        if out.mla_max_logits is not None:
            max_logits = out.mla_max_logits if max_logits is None else torch.maximum(max_logits, out.mla_max_logits)
    if parallel is not None:
        parallel.finish_gradients()
        parallel.sum_(loss_sum)
        for hist, layer_loads in zip(histograms, loads):
            parallel.sum_(hist.counts)
            parallel.sum_(layer_loads)
        if max_logits is not None:
            parallel.max_(max_logits)
        grad_norm = parallel.clip_grad_norm_(cfg.grad_clip)
        head = [loss_sum.reshape(1)]
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        head = [loss_sum.reshape(1), norm.to(loss_sum.device, torch.float64).reshape(1)]
    # Everything the host needs from this step (loss, gradient norm, expert loads, QB token counts, QK-Clip's
    # numbers) in one read before the update: the host waits for the GPU once per step, and nothing after the
    # optimizer step waits, so the next step's launches can overlap the optimizer's kernels.
    clipping = max_logits is not None and cfg.qk_clip_tau > 0
    n_moe = len(moes)
    tail = ([layer_load_stats(torch.stack(loads)).reshape(-1),  # [2·n_moe]: mean and max load per layer
             torch.stack([hist.counts[0].sum() for hist in histograms]).double()]  # [n_moe]: QB's token counts
            if moes else []) + ([qk_clip_stats(max_logits, cfg.qk_clip_tau)] if clipping else [])
    read = torch.cat([t.to(loss_sum.device) for t in head + tail]).tolist()
    if parallel is None:
        grad_norm = read.pop(1)
    loss_sum = read.pop(0)
    load_means, load_maxes, qb_tokens = read[:n_moe], read[n_moe:2 * n_moe], read[2 * n_moe:3 * n_moe]
    clip_stats = read[3 * n_moe:]
    loss_value = loss_sum / total_tokens
    lr = optimizer.param_groups[0]["lr"]
    metrics: dict[str, Any] = {"loss": loss_value, "grad_norm": grad_norm, "lr": lr, "tokens": total_tokens}
    if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
        # a bad step changes nothing: no update, no bias update; the schedule still advances
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        metrics["skipped"] = True
        return metrics
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    if clipping:
        clip = qk_clip_(model, max_logits, cfg.qk_clip_tau, stats=clip_stats)
        metrics["qk_clip_heads"] = clip["clipped_heads"]
        metrics["mla_max_logit"] = clip["max_logit"]
    with torch.no_grad():
        for moe, hist, m in zip(moes, histograms, qb_tokens):
            moe.gate.e_score_correction_bias.copy_(hist.bias(moe.top_k, num_tokens=round(m)))
    imbalance = imbalance_from_stats(load_means, load_maxes)
    metrics["moe_max_over_mean"], metrics["moe_max_vio"] = imbalance["max_over_mean"], imbalance["max_vio"]
    if parallel is not None:
        metrics.update(parallel.ep_stats())
    return metrics


@torch.no_grad()
def evaluate(model: K3ForCausalLM, corpus: TokenizedCorpus, seq_len: int, max_tokens: int,
             device: torch.device, parallel: ParallelTraining | None = None) -> dict[str, float]:
    """Mean held-out loss per token (QB biases frozen: routing is plain top-k of s + b)."""
    model.eval()
    dp = parallel.runtime.dims.dp if parallel is not None else 1
    rows = dp * max(1, min(8, max_tokens // seq_len) // dp)
    loss_sum, count = 0.0, 0
    for batch in PackedBatches.eval(corpus, rows, seq_len):
        if parallel is not None:  # cut on the host, move only this rank's piece
            input_ids, labels, cu_seqlens = parallel.shard(batch.input_ids, batch.labels, batch.cu_seqlens)
        else:
            batch = batch.to(device)
            input_ids, labels, cu_seqlens = batch.input_ids, batch.labels, batch.cu_seqlens
        with autocast_context(device):
            batch_loss = model(input_ids, cu_seqlens=cu_seqlens, labels=labels).loss.double()
        loss_sum += float(parallel.sum_(batch_loss) if parallel is not None else batch_loss)
        count += batch.num_tokens
        if count >= max_tokens:
            break
    loss = loss_sum / max(count, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}


def _check_out_dir(out: Path, cfg: TrainConfig, resume: bool) -> TrainConfig:
    """Refuse to mix runs; on resume, return the stored configuration (with allowed overrides applied)."""
    run_file = out / "run.json"
    if run_file.exists():
        stored = TrainConfig.from_dict(json.loads(run_file.read_text())["train_config"])
        if not resume:
            raise ValueError(f"{out} already holds a training run; pass --resume to continue it, "
                             f"or choose another --out")
        new, old = cfg.as_dict(), stored.as_dict()
        differing = sorted(k for k in new if new[k] != old[k] and k not in RESUMABLE_OVERRIDES)
        if differing:
            raise ValueError(f"{out} holds a run with different settings ({', '.join(differing)}); "
                             f"resume it with its own settings or choose another --out")
        return cfg
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not a k3 training run (no run.json); choose another --out")
    return cfg


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "python_pos": random.getstate()[2], "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
             "numpy_pos": int(np_state[2])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        # a run may resume on a machine with fewer GPUs: restore the devices that exist
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def stage_at(cfg: TrainConfig, step: int, total_steps: int) -> ContextStage:
    boundary = 0.0
    for stage in cfg.stages:
        boundary += stage.fraction * total_steps
        if step < round(boundary):
            return stage
    return cfg.stages[-1]


@dataclass
class RunSummary:
    out: Path
    steps: int
    tokens: int
    final_train_loss: float
    final_eval_loss: float
    unigram_entropy: float
    seconds: float
    checkpoint: Path | None


def train(cfg: TrainConfig, resume: bool = False, log=print, progress: bool = True) -> RunSummary:
    """Run (or resume) training as configured; returns a summary. Raises ValueError on bad settings."""
    cfg.validate()
    out = Path(cfg.out)
    runtime = _distributed_runtime(cfg)
    is_main = runtime is None or runtime.is_main
    if not is_main:
        log, progress = (lambda *args, **kwargs: None), False
    run_file = out / "run.json"
    fresh_run = not run_file.exists()  # decided before rank 0 may start writing it
    if is_main:
        cfg = _check_out_dir(out, cfg, resume)
    _barrier(runtime)
    if runtime is not None:
        _check_parallel_layout(cfg, runtime)
    device = runtime.device if runtime is not None else resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    started = time.perf_counter()

    preset = get_preset(cfg.preset)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = cfg.vocab_size or preset.vocab_size
    if is_main:  # the others read what rank 0 built
        tokenizer, train_corpus, heldout_corpus = prepare_data(cfg, vocab_size, out, log)
    _barrier(runtime)
    if not is_main:
        tokenizer, train_corpus, heldout_corpus = prepare_data(cfg, vocab_size, out, log)
    model_config = preset.replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                  eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                                  media_placeholder_token_id=tokenizer.special_id("<|media_pad|>"))
    model = build_model(model_config, seed=cfg.seed, device=device)
    if runtime is not None:
        parallel = parallelize(model, runtime, moonep=cfg.moonep, activation_checkpointing=cfg.activation_checkpointing)
    else:
        parallel = None
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(model)
    optimizer_class = DistributedMuonAdamW if parallel is not None else MuonAdamW
    optimizer = optimizer_class(model.named_parameters(), model_config, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                ns_dtype=ns_dtype_for(cfg.muon_ns_dtype, device), impl=cfg.optimizer_impl)

    metrics_log = MetricsLog(out / "metrics.jsonl") if is_main else _NoLog()
    ckpt_root = out / "checkpoints"
    start_step, tokens_seen, data_state = 0, 0, None
    if not fresh_run:
        run_info = json.loads(run_file.read_text())
        total_steps = run_info["total_steps"]
    else:
        total_steps = _resolve_total_steps(cfg, model, train_corpus, device, log, parallel)
        if is_main:
            git = git_state()
            run_info = {"train_config": cfg.as_dict(), "total_steps": total_steps, "git_revision": git["revision"],
                        "python": sys.version, "torch": torch.__version__,
                        "world_size": runtime.world_size if runtime is not None else 1}
            model_config.save(out / "config.json")
            (out / "git.diff").write_text(git["diff"])
            run_file.write_text(json.dumps(run_info, indent=2))
    _barrier(runtime)
    scheduler = cosine_schedule(optimizer, total_steps, cfg.warmup_frac, cfg.min_lr_ratio)

    if resume:
        ckpt = latest_checkpoint(ckpt_root)
        if ckpt is not None:
            stored_config = ModelConfig.load(ckpt / "config.json")
            if stored_config != model_config:
                raise CheckpointError(f"{ckpt} was written for a different model configuration")
            distributed_ckpt = (ckpt / DCP_MARKER).exists()
            if distributed_ckpt != (parallel is not None):
                raise CheckpointError(f"{ckpt} is a {'distributed' if distributed_ckpt else 'single-process'} "
                                      f"checkpoint: resume it {'under torchrun (any number of processes)' if distributed_ckpt else 'without torchrun'}")
            if parallel is not None:
                if is_main:
                    verify_checkpoint(ckpt)
                _barrier(runtime)
                parallel.load(ckpt, optimizer)
                state = torch.load(ckpt / "train_state.pt", weights_only=True)
            else:
                tensors, state = load_checkpoint(ckpt)
                model.load_state_dict({k: v.to(device) for k, v in tensors.items()})
                optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            _set_rng_state(state["rng"])
            start_step, tokens_seen, data_state = state["step"], state["tokens"], state["data"]
            log(f"resumed from {ckpt} (step {start_step})")
        metrics_log.truncate_after(start_step)
    unigram = train_corpus.unigram_entropy()
    if start_step == 0:
        metrics_log.write({"kind": "event", "step": 0, "event": "start", "unigram_entropy": unigram,
                           "train_tokens": train_corpus.num_tokens, "heldout_tokens": heldout_corpus.num_tokens,
                           "total_steps": total_steps, "params": sum(p.numel() for p in model.parameters())})

    stage = stage_at(cfg, start_step, total_steps)
    batches = _make_batches(train_corpus, cfg, stage)
    if data_state is not None:
        batches.load_state_dict(data_state)

    def save(step: int) -> Path:
        state = {"scheduler": scheduler.state_dict(), "rng": _rng_state(), "step": step, "tokens": tokens_seen,
                 "data": batches.state_dict()}
        extra_files = {"config.json": json.dumps(model_config.to_config_json(), indent=2)}
        extra_dirs = {"tokenizer": out / "tokenizer"}
        if parallel is None:
            return save_checkpoint(ckpt_root, step, model.state_dict(), {**state, "optimizer": optimizer.state_dict()},
                                   extra_files=extra_files, extra_dirs=extra_dirs, keep=cfg.keep_checkpoints)
        # distributed: every rank writes its shards (DCP), rank 0 adds the rest and commits atomically
        tmp = ckpt_root / (step_dir_name(step) + ".tmp")
        if is_main:
            new_checkpoint_dir(ckpt_root, step)
        _barrier(runtime)
        parallel.save(tmp, optimizer)
        _barrier(runtime)
        if is_main:
            write_train_state(tmp, state, extra_files, extra_dirs)
            commit_checkpoint(ckpt_root, step, tmp, cfg.keep_checkpoints)
        _barrier(runtime)
        return ckpt_root / step_dir_name(step)

    from tqdm.auto import tqdm

    bar = tqdm(total=total_steps, initial=start_step, desc=f"train {cfg.preset}", unit="step",
               disable=not progress, dynamic_ncols=True)
    bad_in_a_row, last_eval, last_ckpt = 0, float("nan"), latest_checkpoint(ckpt_root)
    last_train_loss = float("nan")
    for record in metrics_log.read() if start_step else []:  # a resumed run reports where it stands
        if record.get("kind") == "train" and not record.get("skipped"):
            last_train_loss = record["loss"]
        elif record.get("kind") == "eval":
            last_eval = record["loss"]
    window_start, window_tokens = time.perf_counter(), 0
    step = start_step
    try:
        while step < total_steps:
            new_stage = stage_at(cfg, step, total_steps)
            if new_stage.seq_len != batches.seq_len:
                state = batches.state_dict()
                batches = _make_batches(train_corpus, cfg, new_stage)
                batches.load_state_dict(state)
                metrics_log.write({"kind": "event", "step": step, "event": "stage", "seq_len": new_stage.seq_len})
            micro = [next(batches) for _ in range(cfg.micro_batches)]
            metrics = train_step(model, optimizer, scheduler, micro, cfg, device, parallel)
            step += 1
            tokens_seen += metrics["tokens"]
            window_tokens += metrics["tokens"]
            record = {"kind": "train", "step": step, "tokens_seen": tokens_seen, "seq_len": batches.seq_len,
                      **metrics}
            if metrics.get("skipped"):
                bad_in_a_row += 1
                log(f"step {step}: non-finite loss or gradient (loss {metrics['loss']}, grad norm "
                    f"{metrics['grad_norm']}); update skipped ({bad_in_a_row} in a row)")
                if bad_in_a_row >= cfg.max_bad_steps:
                    metrics_log.write(record)
                    raise TrainingError(f"{bad_in_a_row} non-finite steps in a row at step {step}; stopping. "
                                        f"The last good checkpoint is {last_ckpt}")
            else:
                bad_in_a_row = 0
                last_train_loss = metrics["loss"]
            elapsed = time.perf_counter() - window_start
            record["tokens_per_s"] = window_tokens / max(elapsed, 1e-9)
            metrics_log.write(record)
            if step % cfg.eval_every == 0 or step == total_steps:
                ev = evaluate(model, heldout_corpus, batches.seq_len, cfg.eval_tokens, device, parallel)
                last_eval = ev["loss"]
                metrics_log.write({"kind": "eval", "step": step, **ev})
            if step % cfg.checkpoint_every == 0 or step == total_steps:
                last_ckpt = save(step)
            bar.set_postfix(loss=f"{last_train_loss:.3f}", eval=f"{last_eval:.3f}",
                            tok_s=f"{record['tokens_per_s']:,.0f}", lr=f"{metrics['lr']:.2e}")
            bar.update(1)
            window_start, window_tokens = time.perf_counter(), 0
    finally:
        bar.close()
    if is_main:
        plot_run(out / "metrics.jsonl", out / "plots", title=f"k3 {cfg.preset}")
    return RunSummary(out, step, tokens_seen, last_train_loss, last_eval, unigram,
                      time.perf_counter() - started, last_ckpt)


def _distributed_runtime(cfg: TrainConfig) -> ParallelRuntime | None:
    """The process group when launched by torchrun (RANK and WORLD_SIZE set, 1 process included)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if cfg.context_parallel > 1 or cfg.expert_parallel:
            raise ValueError("context_parallel / expert_parallel need several processes: launch with torchrun")
        return None
    device = None if cfg.device == "auto" else cfg.device
    return ParallelRuntime.from_env(cp=cfg.context_parallel, expert_parallel=cfg.expert_parallel, device=device)


def _check_parallel_layout(cfg: TrainConfig, runtime: ParallelRuntime) -> None:
    """Every context stage must cut evenly: rows over dp, each row into cp slices longer than the conv halo."""
    dp, cp = runtime.dims.dp, runtime.dims.cp
    for stage in cfg.stages:
        rows = cfg.tokens_per_step // (stage.seq_len * cfg.micro_batches)
        if rows % dp:
            raise ValueError(f"stage seq_len {stage.seq_len}: {rows} rows per micro-batch do not split over dp={dp}")
        if stage.seq_len % cp or stage.seq_len // cp < 4:
            raise ValueError(f"stage seq_len {stage.seq_len} must split into cp={cp} slices of at least 4 tokens")


def _barrier(runtime: ParallelRuntime | None) -> None:
    if runtime is not None:
        torch.distributed.barrier()


class _NoLog:
    """Metrics log of ranks other than 0: they compute the same metrics, rank 0 writes them."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def read(self) -> list[dict[str, Any]]:
        return []


def _make_batches(corpus: TokenizedCorpus, cfg: TrainConfig, stage: ContextStage) -> PackedBatches:
    rows = cfg.tokens_per_step // (stage.seq_len * cfg.micro_batches)
    return PackedBatches(corpus, rows, stage.seq_len, seed=cfg.seed, streams=cfg.data_streams)


def _resolve_total_steps(cfg: TrainConfig, model: K3ForCausalLM, corpus: TokenizedCorpus, device: torch.device,
                         log, parallel: ParallelTraining | None = None) -> int:
    """Total optimizer steps: from max_steps, max_tokens, or a time budget measured on this machine."""
    if cfg.max_steps is not None:
        return cfg.max_steps
    if cfg.max_tokens is not None:
        return max(1, cfg.max_tokens // cfg.tokens_per_step)
    if cfg.time_budget_min is None:
        raise ValueError("set one of max_steps, max_tokens or time_budget_min")
    if parallel is not None:
        raise ValueError("a distributed run needs max_steps or max_tokens (the time-budget probe is single-process)")
    # time full steps on a throwaway copy of the model; nothing of the run is touched
    probe = build_model(model.config, seed=cfg.seed, device=device)
    probe_opt = MuonAdamW(probe.named_parameters(), model.config, lr=0.0,
                          ns_dtype=ns_dtype_for(cfg.muon_ns_dtype, device))
    probe_sched = cosine_schedule(probe_opt, 10)
    seconds = {}
    for stage in cfg.stages:
        if stage.seq_len in seconds:
            continue
        batches = _make_batches(corpus, cfg, stage)
        micro = [next(batches) for _ in range(cfg.micro_batches)]
        train_step(probe, probe_opt, probe_sched, micro, cfg, device)
        # the faster of two warm steps: a transient load spike on a shared machine should not shrink the run
        timings = []
        for _ in range(2):
            start = time.perf_counter()
            train_step(probe, probe_opt, probe_sched, micro, cfg, device)
            timings.append(time.perf_counter() - start)
        seconds[stage.seq_len] = min(timings)
    step_seconds = sum(seconds[st.seq_len] * st.fraction for st in cfg.stages)
    # evaluation and checkpoints take a share of the budget too; leave 15%
    total = max(1, int(cfg.time_budget_min * 60 * 0.85 / step_seconds))
    log(f"time budget {cfg.time_budget_min:g} min at ~{step_seconds:.2f} s/step → {total} steps")
    return total
