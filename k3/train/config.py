"""Training settings: `TrainConfig`, every default in one place, and its context stages. `validate` runs before
anything is written; run.json stores the resolved settings (`run_info.py`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ContextStage:
    """Train at `seq_len` for this `fraction` of the optimizer steps (progressive context extension)."""

    seq_len: int
    fraction: float


@dataclass
class TrainConfig:
    preset: str = "tiny"
    data: str | None = None  # None: the running Python's standard library sources
    # what `data` holds: "text" documents (k3 train), "conversations" (k3 sft, k3.posttrain) or "multimodal" rows
    # with images (k3 train, k3.vision.data); the command that trains the run passes the matching data source
    data_format: str = "text"
    # a run or checkpoint folder to start from (its model config, weights and tokenizer: fine-tuning);
    # None: a freshly initialised `preset` model with a tokenizer trained on the data
    init_from: str | None = None
    out: str = "runs/tiny"
    # batch: tokens per optimizer step = batch_rows × seq_len of the current stage (constant across stages)
    tokens_per_step: int = 2048
    micro_batches: int = 1  # gradient accumulation
    stages: list[ContextStage] = field(default_factory=lambda: [ContextStage(256, 0.8), ContextStage(512, 0.2)])
    data_streams: int = 16  # rows of a batch come from this many interleaved document streams (data.py)
    # length of the run: the first of these that is set
    max_steps: int | None = None
    max_tokens: int | None = None
    max_epochs: float | None = None  # passes over the training data, counted in packed rows
    time_budget_min: float | None = None
    # optimizer (docs/optimizer.md): one learning rate for Muon (RMS-matched) and AdamW
    lr: float = 6e-3
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.01
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    qk_clip_tau: float = 100.0
    # a multimodal run's tower and projector learning rate (their own Muon and AdamW groups, docs/vision.md);
    # None: lr
    vision_lr: float | None = None
    # Newton–Schulz precision: "auto" = bf16 as in the K3 report on CUDA and on CPUs that multiply bf16 natively
    # (AVX512-BF16 / AMX, where it is faster than fp32), fp32 on other CPUs (`ns_dtype_for`); or "bfloat16", "float32"
    muon_ns_dtype: str = "auto"
    # the optimizer step: "auto" = fused kernels on CUDA (docs/optimizer.md, "Fused step"), "reference" = foreach
    optimizer_impl: str = "auto"
    qb_bins: int = 1000
    # the baselines K3's choices replaced, for `k3 ablate` (docs/ablations.md): "whole_matrix_muon" orthogonalises
    # the attention projections whole instead of per head, "adamw" runs AdamW on every parameter; "sign" replaces
    # Quantile Balancing by the sign-based bias update b += sign_update_rate · sign(mean load - load) (DeepSeek-V3's)
    optimizer: str = "per_head_muon"
    router_balancing: str = "quantile"
    sign_update_rate: float = 1e-3
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
        """Raise ValueError for any setting that cannot run: called before anything is written."""
        for name in ("max_steps", "max_tokens", "tokens_per_step", "micro_batches", "eval_every", "eval_tokens",
                     "checkpoint_every", "keep_checkpoints", "log_every", "max_bad_steps", "qb_bins",
                     "data_streams", "context_parallel"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("time_budget_min", "max_epochs", "lr", "grad_clip", "vision_lr"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if not self.stages:
            raise ValueError("at least one context stage is needed")
        if abs(sum(s.fraction for s in self.stages) - 1.0) > 1e-6:
            raise ValueError(f"stage fractions must sum to 1, got {[s.fraction for s in self.stages]}")
        for s in self.stages:
            if not s.fraction > 0 or s.seq_len < 2:
                raise ValueError(f"a stage needs seq_len >= 2 and a positive fraction, got {s}")
            if self.tokens_per_step % (s.seq_len * self.micro_batches):
                raise ValueError(f"tokens_per_step ({self.tokens_per_step}) must be a multiple of seq_len × "
                                 f"micro_batches ({s.seq_len} × {self.micro_batches})")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0) or not self.qk_clip_tau >= 0:
            raise ValueError(f"weight_decay and qk_clip_tau must be >= 0, got {self.weight_decay}, {self.qk_clip_tau}")
        if not 0 <= self.warmup_frac < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"warmup_frac must be in [0, 1) and min_lr_ratio in [0, 1], got {self.warmup_frac}, "
                             f"{self.min_lr_ratio}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if self.init_from is not None and self.vocab_size is not None:
            raise ValueError("vocab_size cannot be set when starting from a checkpoint (init_from): the checkpoint's "
                             "tokenizer is used")
        if self.vocab_size is not None and self.vocab_size < 512:
            raise ValueError(f"vocab_size must be at least 512 (256 bytes + 256 special tokens), got {self.vocab_size}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.muon_ns_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"muon_ns_dtype must be auto, bfloat16 or float32, got {self.muon_ns_dtype!r}")
        if self.optimizer not in ("per_head_muon", "whole_matrix_muon", "adamw"):
            raise ValueError(f"optimizer must be per_head_muon, whole_matrix_muon or adamw, got {self.optimizer!r}")
        if self.router_balancing not in ("quantile", "sign") or not self.sign_update_rate > 0:
            raise ValueError(f"router_balancing must be quantile or sign (with sign_update_rate > 0), got "
                             f"{self.router_balancing!r}, {self.sign_update_rate!r}")
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



def stage_at(cfg: TrainConfig, step: int, total_steps: int) -> ContextStage:
    """The context stage that optimizer step `step` (0-based) of a `total_steps` run trains in."""
    boundary = 0.0
    for stage in cfg.stages:
        boundary += stage.fraction * total_steps
        if step < round(boundary):
            return stage
    return cfg.stages[-1]

