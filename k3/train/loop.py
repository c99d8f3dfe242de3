"""The training loop, top to bottom: data → model → Per-Head Muon/AdamW → QK-Clip → Quantile Balancing.

One optimizer step:
1. draw the step's micro-batches (packed rows with `cu_seqlens`; labels -100 at fragment ends);
2. for each: forward with router statistics and MLA max logits, loss = Σ token CE / (labelled tokens of
   the whole step), backward; add the router's required biases to each MoE layer's QB histogram;
3. clip the gradient norm; skip the update if the loss or the norm is not finite;
4. optimizer step, learning-rate step, QK-Clip with the step's per-head max logits;
5. Quantile Balancing: each MoE layer's bias becomes the histogram quantile, used from the next step.
Evaluation freezes the biases (no histogram). Checkpoints are atomic (`k3.checkpoint`) and a resumed run
continues exactly: same data position, optimizer and scheduler state, RNG, biases and metrics log.

One process or the ranks of a torchrun launch run the same code: the loop asks its runtime (`runtime.py`) to
wrap the model and optimizer, reduce metrics, wait for the other processes, and write or read checkpoints.
`train` reads top to bottom; the pieces it calls follow it (setting up, one step, checkpoints). A `Run`
holds everything between two steps, so `save(run)` checkpoints it wherever the loop stands between steps.
The settings are `config.py`; which folder a run may start or resume in, and run.json, are `run_info.py`.

SIGINT/SIGTERM are honoured at the next step boundary: the ranks agree through the step's own all-reduce (no
extra collective), then checkpoint and draw the plots. A step with any non-finite value (loss, gradient norm,
router scores, MLA max logits) is skipped, never half-applied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from k3.checkpoint import (CheckpointError, commit_checkpoint, latest_checkpoint, new_checkpoint_dir, read_model,
                           resolve_checkpoint, step_dir_name, verify_checkpoint, write_text_atomic, write_train_state)
from k3.config import ModelConfig, get_preset
from k3.model.model import K3ForCausalLM, build_model
from k3.model.moe import StableLatentMoE
from k3.model.quantile_balancing import QuantileHistogram, expert_loads, imbalance_from_stats, layer_load_stats
from k3.ops.weight_grads import accumulating_weight_grads
from k3.optim import MuonAdamW, cosine_schedule, qk_clip_, qk_clip_stats
from k3.parallel.parallelize import DCP_MARKER, ParallelTraining
from k3.parallel.runtime import ParallelRuntime
from k3.runfolder import DiskFull, RunError, StopSignals, check_writable_folder, disk_full
from k3.tokenizer import Tokenizer, train_bpe
from k3.train.config import ContextStage, TrainConfig, stage_at
from k3.train.data import (PackedBatches, TextDocuments, TokenizedCorpus, documents_fingerprint, prepare_corpus,
                           split_documents)
from k3.train.metrics import MetricsLog, NullMetricsLog, plot_run
from k3.train.run_info import own_folder, retarget_length, stored_total_steps, write_run_info
from k3.train.runtime import SingleProcess, resolve_device, start_runtime


# TrainConfig.optimizer -> MuonAdamW's muon_blocks
MUON_BLOCKS = {"per_head_muon": "per_head", "whole_matrix_muon": "whole_matrix", "adamw": "none"}


class TrainingError(RunError):
    """The run cannot continue (e.g. repeated non-finite steps); the last checkpoint is usable."""


def prepare_data(cfg: TrainConfig, vocab_size: int, out: Path, log, source=None) -> tuple[Tokenizer, TokenizedCorpus,
                                                                                            TokenizedCorpus]:
    """Tokenizer and tokenized train/held-out corpora under `out/`, reused when already built. Once the run
    exists (run.json), data whose content differs from what its corpus was prepared from is refused.

    `source`: the data source (`k3.train.data.TextDocuments` of `cfg.data` by default). The tokenizer is the
    `init_from` checkpoint's, or a BPE of `vocab_size` trained on the training documents. A source of whole
    documents drops those longer than the shortest context stage, and says how many."""
    source = TextDocuments(cfg.data) if source is None else source
    docs = source.documents()
    if not docs:
        raise ValueError(f"no documents found in {cfg.data!r}")
    train_docs, heldout_docs = split_documents(docs, cfg.heldout_fraction, seed=cfg.seed)
    if not train_docs or not heldout_docs:
        raise ValueError(f"the data holds {len(docs)} document(s); at least 2 are needed for a held-out split")
    tok_dir = out / "tokenizer"
    if (tok_dir / "tokenizer.json").exists() or (tok_dir / "tiktoken.model").exists():
        tokenizer = Tokenizer.load(tok_dir)
    else:
        if cfg.init_from is not None:
            tokenizer = Tokenizer.load(Path(cfg.init_from) / "tokenizer")
        else:
            log(f"training a {vocab_size}-token byte-level BPE on {len(train_docs):,} documents")
            tokenizer = train_bpe((text for _, text in train_docs), vocab_size)
        # saved whole or not at all: a start killed here must not leave a tokenizer to reuse half-written
        tmp = out / "tokenizer.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tokenizer.save(tmp)
        shutil.rmtree(tok_dir, ignore_errors=True)
        tmp.replace(tok_dir)
    max_document_tokens = min(s.seq_len for s in cfg.stages) if source.whole_documents else None
    corpora = []
    for split, split_docs in (("train", train_docs), ("heldout", heldout_docs)):
        directory = out / "data" / split
        fingerprint = documents_fingerprint(split_docs) + tokenizer.fingerprint()
        if max_document_tokens is not None:
            fingerprint += f":{source.format}:{max_document_tokens}"  # which documents fit decides the corpus
        meta_path = directory / "meta.json"
        try:
            prepared = json.loads(meta_path.read_text()).get("run_fingerprint") if meta_path.exists() else None
        except (OSError, ValueError):
            prepared = None  # damaged: rebuilt below
        if prepared is not None and prepared != fingerprint and (out / "run.json").exists():
            started = json.loads((out / "run.json").read_text())["train_config"].get("data")
            raise ValueError(f"the data ({cfg.data or 'the standard library'}) differs from the data this run was "
                             f"prepared from ({started or 'the standard library'}); resume with that data, or start "
                             f"a new run in another folder")
        if prepared != fingerprint:
            prepare_corpus(split_docs, tokenizer, directory, source=source, max_document_tokens=max_document_tokens)
            meta = json.loads(meta_path.read_text())
            meta["run_fingerprint"] = fingerprint
            write_text_atomic(meta_path, json.dumps(meta))
        corpus = TokenizedCorpus.open(directory)
        if hasattr(source, "media"):  # a multimodal source: each kept document's images, in corpus order
            left_out = set(corpus.meta.get("skipped", []))
            corpus.media = source.media(tokenizer, [text for name, text in split_docs if name not in left_out])
        skipped = corpus.meta.get("skipped", [])
        if skipped:
            shown = ", ".join(skipped[:5]) + (", …" if len(skipped) > 5 else "")
            log(f"{split}: skipped {len(skipped):,} of {len(split_docs):,} documents longer than the "
                f"{max_document_tokens:,}-token context ({shown})")
        corpora.append(corpus)
    return tokenizer, corpora[0], corpora[1]


def moe_layers(model: K3ForCausalLM) -> list[StableLatentMoE]:
    return [layer.block_sparse_moe for layer in model.model.layers if layer.is_moe]


def ns_dtype_for(name: str, device: torch.device) -> torch.dtype:
    """`TrainConfig.muon_ns_dtype` on `device`. "auto": bf16 on CUDA and on CPUs whose oneDNN multiplies bf16
    natively, fp32 on the others, where bf16 matmuls take a slow generic path (docs/optimizer.md, "The Muon step")."""
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


def train_step(model: K3ForCausalLM, optimizer, scheduler, batches: list, cfg: TrainConfig, device: torch.device,
               parallel: SingleProcess | ParallelTraining | None = None,
               stop_signal: Callable[[], int | None] | None = None) -> dict[str, Any]:
    """One optimizer step over `batches` (micro-batches). Returns the step's metrics.

    `parallel`: the runtime bound to the model (None: one process, `SingleProcess`). Distributed, every rank gets
    the same global micro-batches and keeps its piece; losses, QB histograms, expert loads and MLA max logits are
    reduced over all ranks, so the metrics and the update equal the single-process step on the global batch.
    `stop_signal`: asked once, just before the step's reduction, for the signal number of a pending stop request
    (None or 0: none); `metrics["stop"]` is that signal if any rank has one (else 0), the same on every rank, so
    all of them stop at the same step boundary.
    """
    parallel = parallel if parallel is not None else SingleProcess(device, model)
    model.train()
    moes = moe_layers(model)
    histograms = [QuantileHistogram(m.gate.e_score_correction_bias, cfg.qb_bins,
                                    fused=m.gate.fast(m.gate.e_score_correction_bias)) for m in moes]
    loads = [torch.zeros(m.gate.e_score_correction_bias.numel(), dtype=torch.int64, device=device) for m in moes]
    max_logits = None
    total_tokens = sum(b.num_tokens for b in batches)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # stays on the device until the step's one read
    score_sum = torch.zeros((), dtype=torch.float64, device=device)  # not finite iff a router score is not
    for batch in batches:
        # cut on the host; a rank moves only its piece, one process passes host tensors the model copies
        input_ids, labels, cu_seqlens = parallel.shard(batch.input_ids, batch.labels, batch.cu_seqlens)
        with autocast_context(device):
            # a multimodal batch (k3.vision.data, one process) carries the model's media inputs: pixel_values, grid_thw
            out = model(input_ids, cu_seqlens=cu_seqlens, return_router_infos=True, return_mla_max_logits=True,
                        labels=labels, **getattr(batch, "media", {}))
        loss = out.loss
        with accumulating_weight_grads(parallel.in_place_weight_grads):
            (loss * (parallel.loss_scale / total_tokens)).backward()
        loss_sum += loss.detach().double()
        if len(out.router_infos) != len(moes):
            raise TrainingError(f"the forward reported {len(out.router_infos)} router statistics for "
                                f"{len(moes)} MoE layers (a wrapper dropped them)")
        for hist, layer_loads, info in zip(histograms, loads, out.router_infos):
            score_sum += info.scores.sum(dtype=torch.float64)
            # the histogram bins a NaN score into bin 0; such a step is skipped below (score_sum)
            hist.add(info.scores, info.cutoff)
            layer_loads += expert_loads(info.topk_idx, layer_loads.numel())
        if out.mla_max_logits is not None:
            max_logits = out.mla_max_logits if max_logits is None else torch.maximum(max_logits, out.mla_max_logits)
    parallel.finish_gradients()
    # a stop request rides on the loss's all-reduce: every rank learns the others' answer without a collective
    signum = (stop_signal() or 0) if stop_signal is not None else 0
    stopping, signums = loss_sum.new_full((), float(signum > 0)), loss_sum.new_full((), float(signum))
    control = parallel.sum_(torch.stack([loss_sum, score_sum, stopping, signums]))  # [4]
    for hist, layer_loads in zip(histograms, loads):
        parallel.sum_(hist.counts)
        parallel.sum_(layer_loads)
    if max_logits is not None:
        parallel.max_(max_logits)
    grad_norm = parallel.clip_grad_norm_(cfg.grad_clip)
    # Everything the host needs from this step (loss, gradient norm, expert loads, QB token counts, QK-Clip's
    # numbers) in one read before the update: the host waits for the GPU once per step, and nothing after the
    # optimizer step waits, so the next step's launches can overlap the optimizer's kernels.
    clipping = max_logits is not None and cfg.qk_clip_tau > 0
    n_moe = len(moes)
    head = [control, grad_norm.to(loss_sum.device, torch.float64).reshape(1)]
    tail = ([layer_load_stats(torch.stack(loads)).reshape(-1),  # [2·n_moe]: mean and max load per layer
             torch.stack([hist.counts[0].sum() for hist in histograms]).double()]  # [n_moe]: QB's token counts
            if moes else []) + ([qk_clip_stats(max_logits, cfg.qk_clip_tau)] if clipping else [])
    loss_sum, score_sum, stopping, signums, grad_norm, *read = torch.cat(
        [t.to(loss_sum.device) for t in head + tail]).tolist()
    load_means, load_maxes, qb_tokens = read[:n_moe], read[n_moe:2 * n_moe], read[2 * n_moe:3 * n_moe]
    clip_stats = read[3 * n_moe:]
    loss_value = loss_sum / total_tokens
    lr = optimizer.param_groups[0]["lr"]
    # ranks stopped by different signals (rare) report SIGTERM
    stop = 0 if not stopping else int(signums // stopping) if signums % stopping == 0 else int(signal.SIGTERM)
    metrics: dict[str, Any] = {"loss": loss_value, "grad_norm": grad_norm, "lr": lr, "tokens": total_tokens,
                               "stop": stop}
    nonfinite = [name for name, value in (("loss", loss_value), ("gradient norm", grad_norm),
                                          ("router scores", score_sum)) if not math.isfinite(value)]
    if clipping and clip_stats[0]:
        nonfinite.append("MLA max logits")
    if nonfinite:
        # a bad step changes nothing: no update, no QK-Clip, no bias update; the schedule still advances
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        metrics["skipped"], metrics["nonfinite"] = True, nonfinite
        return metrics
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    if clipping:
        clip = qk_clip_(model, max_logits, cfg.qk_clip_tau, stats=clip_stats)
        metrics["qk_clip_heads"] = clip["clipped_heads"]
        metrics["mla_max_logit"] = clip["max_logit"]
    with torch.no_grad():
        for moe, hist, m, layer_loads in zip(moes, histograms, qb_tokens, loads):
            if cfg.router_balancing == "sign":  # the ablation baseline: b += u · sign(mean load - load)
                error = layer_loads.double().mean() - layer_loads.double()
                moe.gate.e_score_correction_bias.add_(cfg.sign_update_rate * torch.sign(error).float())
                continue
            moe.gate.e_score_correction_bias.copy_(hist.bias(moe.top_k, num_tokens=round(m)))
    imbalance = imbalance_from_stats(load_means, load_maxes)
    metrics["moe_max_over_mean"], metrics["moe_max_vio"] = imbalance["max_over_mean"], imbalance["max_vio"]
    metrics.update(parallel.ep_stats())
    return metrics


@torch.no_grad()
def evaluate(model: K3ForCausalLM, corpus: TokenizedCorpus, seq_len: int, max_tokens: int, device: torch.device,
             parallel: SingleProcess | ParallelTraining | None = None) -> dict[str, float]:
    """Mean held-out loss per token (QB biases frozen: routing is plain top-k of s + b)."""
    parallel = parallel if parallel is not None else SingleProcess(device, model)
    model.eval()
    dp = parallel.dims.dp
    rows = dp * max(1, min(8, max_tokens // seq_len) // dp)
    loss_sum, count = 0.0, 0
    for batch in with_media(PackedBatches.eval(corpus, rows, seq_len), corpus):
        input_ids, labels, cu_seqlens = parallel.shard(batch.input_ids, batch.labels, batch.cu_seqlens)
        with autocast_context(device):
            batch_loss = model(input_ids, cu_seqlens=cu_seqlens, labels=labels,
                               **getattr(batch, "media", {})).loss.double()
        loss_sum += float(parallel.sum_(batch_loss))
        count += batch.num_tokens
        if count >= max_tokens:
            break
    loss = loss_sum / max(count, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}


@dataclass
class Run:
    """A run between two steps: what a checkpoint saves (`save`) and `resume` restores, and what is reported."""

    cfg: TrainConfig
    out: Path
    runtime: SingleProcess | ParallelRuntime
    parallel: SingleProcess | ParallelTraining  # the runtime bound to the model
    model: K3ForCausalLM
    model_config: ModelConfig
    optimizer: MuonAdamW
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total_steps: int
    train_corpus: TokenizedCorpus
    heldout_corpus: TokenizedCorpus
    metrics_log: MetricsLog | NullMetricsLog
    batches: PackedBatches | None = None  # the current context stage's; set once the start step is known
    step: int = 0
    tokens: int = 0
    last_loss: float = float("nan")
    last_eval: float = float("nan")
    last_checkpoint: Path | None = None
    bad_steps: int = 0  # non-finite steps in a row
    stopping: int = 0  # the signal on which the ranks agreed to stop at this step boundary (0: none)


@dataclass
class RunSummary:
    out: Path
    steps: int  # the step the run reached
    tokens: int
    final_train_loss: float
    final_eval_loss: float
    unigram_entropy: float
    seconds: float
    checkpoint: Path | None
    total_steps: int = 0
    start_step: int = 0  # where this call started (the checkpoint it resumed from; 0 for a new run)
    stopped: str | None = None  # the signal that stopped the run before its end ("SIGINT", "SIGTERM")


def train(cfg: TrainConfig, resume: bool | Literal["auto"] = False, log=print, progress: bool = True,
          stop: StopSignals | None = None, source=None) -> RunSummary:
    """Run (or resume) training as configured; returns a summary.

    resume: False starts a run in `cfg.out` (refused if one is there); True continues the run there (refused if
    there is none); "auto" continues it if there is one, else starts it. A folder left by a start that never
    finished (no run.json) is started again. On resume, settings not given keep the run's own length, and a new
    length (max_steps, max_tokens, time_budget_min) retargets the schedule. SIGINT/SIGTERM stop the run at the next
    step boundary with a checkpoint and plots (`RunSummary.stopped`); a second signal raises
    `k3.runfolder.Interrupted` at once; `stop`: the caller's handlers, when it installed them already (the CLI does,
    before importing torch). `source`: the data source (`k3.train.data.TextDocuments` of `cfg.data` by default;
    `k3 sft` passes its conversations), whose `format` must be `cfg.data_format`. Raises ValueError on bad settings
    or data (before anything is written), TrainingError when the run diverges, `k3.runfolder.DiskFull` when a
    checkpoint does not fit.
    """
    cfg.validate()
    get_preset(cfg.preset)
    check_writable_folder(cfg.out)
    if cfg.data is not None and not Path(cfg.data).exists():
        raise ValueError(f"data path {cfg.data!r} does not exist")
    source = TextDocuments(cfg.data) if source is None else source
    if source.format != cfg.data_format:
        raise ValueError(f"this run's data is {cfg.data_format!r} and is trained by its own command (k3 sft for "
                         f"conversations), not by a {source.format!r} data source")
    if cfg.init_from is not None and Path(cfg.init_from).exists():
        # the checkpoint itself, absolute: a run folder's newest checkpoint may change while this run lives
        cfg = dataclasses.replace(cfg, init_from=str(resolve_checkpoint(cfg.init_from).resolve()))
    if "RANK" not in os.environ:
        resolve_device(cfg.device)
    out = Path(cfg.out)
    with stop if stop is not None else StopSignals() as stop:
        runtime = start_runtime(cfg.device, cfg.context_parallel, cfg.expert_parallel)
        if not runtime.is_main:
            log, progress = _silent, False
        with own_folder(out, cfg, resume, runtime, log) as (folder, cfg, fresh):
            for stage in cfg.stages:
                runtime.check_batch_layout(_rows(cfg, stage), stage.seq_len)
            torch.manual_seed(cfg.seed)
            random.seed(cfg.seed)
            np.random.seed(cfg.seed)
            started = time.perf_counter()
            run = _start_run(cfg, out, runtime, fresh, log, source)
            folder.started()  # run.json exists: from here a failure keeps the folder, to be resumed
            data_state = None
            if not fresh:
                data_state = _resume(run, log)
                if retarget_length(out, cfg, run.step, run.total_steps, runtime.is_main, log):
                    run.metrics_log.write({"kind": "event", "step": run.step, "event": "length",
                                           "total_steps": run.total_steps})
            unigram = run.train_corpus.unigram_entropy()
            if run.step == 0:
                run.metrics_log.write({"kind": "event", "step": 0, "event": "start", "unigram_entropy": unigram,
                                       "train_tokens": run.train_corpus.num_tokens,
                                       "heldout_tokens": run.heldout_corpus.num_tokens,
                                       "train_documents": run.train_corpus.num_documents,
                                       "skipped_documents": sum(len(c.meta.get("skipped", [])) for c in
                                                                (run.train_corpus, run.heldout_corpus)),
                                       "total_steps": run.total_steps,
                                       "params": sum(p.numel() for p in run.model.parameters())})
            run.batches = _make_batches(run.train_corpus, cfg, stage_at(cfg, run.step, run.total_steps), data_state)
            _restore_standing(run)
            start_step = run.step
            if run.step == 0 and cfg.init_from is not None and math.isnan(run.last_eval):
                _evaluate(run)  # where a fine-tuning run starts from, on its own held-out data

            from tqdm.auto import tqdm

            bar = tqdm(total=run.total_steps, initial=run.step, desc=f"train {cfg.preset}", unit="step",
                       disable=not progress, dynamic_ncols=True)
            since = time.perf_counter()
            try:
                with stop.at_boundaries():
                    while run.step < run.total_steps and not run.stopping:
                        record = _step(run, since, log, lambda: stop.signum)
                        if run.step % cfg.eval_every == 0 or run.step == run.total_steps:
                            _evaluate(run)
                        if run.step % cfg.checkpoint_every == 0 or run.step == run.total_steps or run.stopping:
                            _checkpoint(run)
                        bar.set_postfix(loss=f"{run.last_loss:.3f}", eval=f"{run.last_eval:.3f}",
                                        tok_s=f"{record['tokens_per_s']:,.0f}", lr=f"{record['lr']:.2e}")
                        bar.update(1)
                        since = time.perf_counter()
                    if run.step == start_step and runtime.is_main:
                        _plot(run)  # nothing trained in this call: the plots still reflect the whole run
            except TrainingError:
                if runtime.is_main:
                    _plot(run)  # show the divergence
                raise
            finally:
                bar.close()
    stopped = signal.Signals(run.stopping).name if run.stopping and run.step < run.total_steps else None
    return RunSummary(out, run.step, run.tokens, run.last_loss, run.last_eval, unigram,
                      time.perf_counter() - started, run.last_checkpoint, run.total_steps, start_step, stopped)


def _start_run(cfg: TrainConfig, out: Path, runtime: SingleProcess | ParallelRuntime, fresh: bool, log,
               source=None) -> Run:
    """Data and tokenizer, the model with its parallelism, the optimizer and schedule; a fresh run's run.json."""
    preset = get_preset(cfg.preset)
    vocab_size = cfg.vocab_size or preset.vocab_size
    if runtime.is_main:  # the others read what the main process built
        tokenizer, train_corpus, heldout_corpus = prepare_data(cfg, vocab_size, out, log, source)
    runtime.barrier()
    if not runtime.is_main:
        tokenizer, train_corpus, heldout_corpus = prepare_data(cfg, vocab_size, out, log, source)
    for stage in cfg.stages:
        _make_batches(train_corpus, cfg, stage)  # a corpus smaller than one batch is refused before run.json
    if cfg.init_from is None:
        model_config = preset.replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                      eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                                      media_placeholder_token_id=tokenizer.special_id("<|media_pad|>"))
    else:  # the model of the checkpoint it starts from (kept in the run folder once the run exists)
        model_config = ModelConfig.load((out if not fresh else Path(cfg.init_from)) / "config.json")
        if model_config.vocab_size != tokenizer.vocab_size:
            raise ValueError(f"{cfg.init_from}: its config.json has {model_config.vocab_size} tokens, its tokenizer "
                             f"{tokenizer.vocab_size}")
    model = build_run_model(model_config, cfg.seed, runtime.device, multimodal=source.format == "multimodal")
    if cfg.init_from is not None and latest_checkpoint(out / "checkpoints") is None:
        _load_initial_weights(model, Path(cfg.init_from), log)
    parallel = runtime.parallelize(model, moonep=cfg.moonep, activation_checkpointing=cfg.activation_checkpointing)
    kwargs = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "ns_dtype": ns_dtype_for(cfg.muon_ns_dtype, runtime.device),
              "impl": cfg.optimizer_impl, "muon_blocks": MUON_BLOCKS[cfg.optimizer]}
    if hasattr(model, "vision_tower"):
        if parallel.distributed:
            raise ValueError("multimodal training runs in one process (a batch's images do not follow its rows "
                             "to the ranks yet)")
        optimizer = MuonAdamW(model.text_named_parameters(), model_config, **kwargs)
        add_vision_groups(optimizer, model, cfg.vision_lr or cfg.lr)
    else:
        optimizer = parallel.build_optimizer(model_config, **kwargs)
    metrics_log = MetricsLog(out / "metrics.jsonl") if runtime.is_main else NullMetricsLog()
    total_steps = None if fresh else stored_total_steps(out, cfg)
    if total_steps is None:
        total_steps = _resolve_total_steps(cfg, model, train_corpus, runtime.device, log, parallel)
    if runtime.is_main and fresh:
        write_run_info(cfg, out, model_config, total_steps, runtime.world_size)
    runtime.barrier()
    scheduler = cosine_schedule(optimizer, total_steps, cfg.warmup_frac, cfg.min_lr_ratio)
    return Run(cfg, out, runtime, parallel, model, model_config, optimizer, scheduler, total_steps, train_corpus,
               heldout_corpus, metrics_log)


def build_run_model(config: ModelConfig, seed: int, device: torch.device, multimodal: bool) -> K3ForCausalLM:
    """The run's model: the text model, or for multimodal data the text model with its tower and projector
    (`k3.vision.model.K3VisionLanguageModel`, the preset's `vision_config`, trained from scratch with it)."""
    if not multimodal:
        return build_model(config, seed=seed, device=device)
    from k3.vision.model import build_vlm

    if config.vision_config is None:
        raise ValueError("multimodal data needs a model with a vision_config (every preset has one)")
    return build_vlm(config, seed=seed, device=device)


def add_vision_groups(optimizer: MuonAdamW, model: K3ForCausalLM, lr: float) -> None:
    """The tower's and projector's Muon and AdamW groups at their own learning rate (k3.vision.optim)."""
    from k3.vision.optim import add_vision_param_groups

    add_vision_param_groups(optimizer, model, lr=lr)


def _load_initial_weights(model: K3ForCausalLM, checkpoint: Path, log) -> None:
    """The weights (Quantile Balancing biases included) of the checkpoint a run starts from, verified first."""
    verify_checkpoint(checkpoint)
    tensors = read_model(checkpoint)
    # a text run fine-tuned on multimodal data: the tower and projector start from their init (docs/vision.md)
    fresh_tower = hasattr(model, "vision_tower") and not any(k.startswith("vision_tower.") for k in tensors)
    missing, unexpected = model.load_state_dict(
        {k: v.to(next(model.parameters()).device) for k, v in tensors.items()}, strict=not fresh_tower)
    assert not unexpected and all(k.startswith(("vision_tower.", "mm_projector.")) for k in missing), missing
    log(f"starting from the weights of {checkpoint}" + (" (the vision tower and projector from scratch: it has "
                                                         "none)" if fresh_tower else ""))


def _resolve_total_steps(cfg: TrainConfig, model: K3ForCausalLM, corpus: TokenizedCorpus, device: torch.device,
                         log, parallel: SingleProcess | ParallelTraining) -> int:
    """Total optimizer steps: from max_steps, max_tokens, max_epochs, or a time budget measured on this machine."""
    if cfg.max_steps is not None:
        return cfg.max_steps
    if cfg.max_tokens is not None:
        return max(1, cfg.max_tokens // cfg.tokens_per_step)
    if cfg.max_epochs is not None:
        # rows one pass fills at the first stage's context (whole documents leave padding: counted, not estimated)
        stage = cfg.stages[0]
        rows = _make_batches(corpus, cfg, stage).rows_per_epoch()
        return max(1, math.ceil(cfg.max_epochs * rows / (_rows(cfg, stage) * cfg.micro_batches)))
    if cfg.time_budget_min is None:
        raise ValueError("set one of max_steps, max_tokens, max_epochs or time_budget_min")
    if parallel.distributed:
        raise ValueError("a distributed run needs max_steps or max_tokens (the time-budget probe is single-process)")
    # time full steps on a throwaway copy of the model; nothing of the run is touched
    multimodal = hasattr(model, "vision_tower")
    probe = build_run_model(model.config, cfg.seed, device, multimodal)
    probe_opt = MuonAdamW(probe.text_named_parameters() if multimodal else probe.named_parameters(), model.config,
                          lr=0.0, ns_dtype=ns_dtype_for(cfg.muon_ns_dtype, device))
    if multimodal:
        add_vision_groups(probe_opt, probe, 0.0)
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


def _rows(cfg: TrainConfig, stage: ContextStage) -> int:
    """Rows of one micro-batch in `stage` (the global batch: every rank builds it and keeps its piece)."""
    return cfg.tokens_per_step // (stage.seq_len * cfg.micro_batches)


def _make_batches(corpus: TokenizedCorpus, cfg: TrainConfig, stage: ContextStage,
                  state: dict[str, Any] | None = None) -> PackedBatches:
    """The batches of `stage`, continuing from a `PackedBatches.state_dict()` when given."""
    batches = with_media(PackedBatches(corpus, _rows(cfg, stage), stage.seq_len, seed=cfg.seed,
                                       streams=cfg.data_streams), corpus)
    if state is not None:
        batches.load_state_dict(state)
    return batches


def with_media(batches: PackedBatches, corpus: TokenizedCorpus):
    """The batches of a multimodal corpus carry their rows' images (`k3.vision.data.MediaBatches`, the same
    position); a text corpus's are returned as they are."""
    if corpus.media is None:
        return batches
    from k3.vision.data import MediaBatches

    return MediaBatches(batches, corpus.media)


def _step(run: Run, since: float, log, stop_signal: Callable[[], int | None] | None = None) -> dict[str, Any]:
    """Advance `run` by one optimizer step (switching context stage when due) and log it; returns its record.
    `since`: when the previous step's bookkeeping ended (the step's throughput is measured from there).
    `stop_signal`: this process's pending stop request; `run.stopping` becomes the ranks' common one."""
    cfg = run.cfg
    stage = stage_at(cfg, run.step, run.total_steps)
    if stage.seq_len != run.batches.seq_len:
        run.batches = _make_batches(run.train_corpus, cfg, stage, run.batches.state_dict())
        run.metrics_log.write({"kind": "event", "step": run.step, "event": "stage", "seq_len": stage.seq_len})
    micro = [next(run.batches) for _ in range(cfg.micro_batches)]
    metrics = train_step(run.model, run.optimizer, run.scheduler, micro, cfg, run.runtime.device, run.parallel,
                         stop_signal)
    run.stopping = metrics.pop("stop")
    run.step += 1
    run.tokens += metrics["tokens"]
    record = {"kind": "train", "step": run.step, "tokens_seen": run.tokens, "seq_len": run.batches.seq_len,
              **metrics}
    if metrics.get("skipped"):
        run.bad_steps += 1
        log(f"step {run.step}: non-finite {', '.join(metrics['nonfinite'])} (loss {metrics['loss']}, grad norm "
            f"{metrics['grad_norm']}); update skipped ({run.bad_steps} in a row)")
        if run.bad_steps >= cfg.max_bad_steps:
            run.metrics_log.write(record)
            last = run.last_checkpoint or "not written yet (no step was checkpointed)"
            raise TrainingError(f"{run.bad_steps} non-finite steps in a row at step {run.step}; stopping. "
                                f"The last good checkpoint is {last}")
    else:
        run.bad_steps = 0
        run.last_loss = metrics["loss"]
    record["tokens_per_s"] = metrics["tokens"] / max(time.perf_counter() - since, 1e-9)
    run.metrics_log.write(record)
    return record


def _evaluate(run: Run) -> None:
    """Held-out loss at the current context length, logged."""
    ev = evaluate(run.model, run.heldout_corpus, run.batches.seq_len, run.cfg.eval_tokens, run.runtime.device,
                  run.parallel)
    run.last_eval = ev["loss"]
    run.metrics_log.write({"kind": "eval", "step": run.step, **ev})


def _restore_standing(run: Run) -> None:
    """The last checkpoint, and for a resumed run its last train and eval losses, to report where it stands."""
    run.last_checkpoint = latest_checkpoint(run.out / "checkpoints")
    for record in run.metrics_log.read() if run.step else []:
        if record.get("kind") == "train" and not record.get("skipped"):
            run.last_loss = record["loss"]
        elif record.get("kind") == "eval":
            run.last_eval = record["loss"]


def _silent(*args, **kwargs) -> None:
    pass


def _checkpoint(run: Run) -> None:
    """Save `run` (unless this step is saved already) and redraw the plots, so a stopped run has both."""
    if run.last_checkpoint is None or run.last_checkpoint.name != step_dir_name(run.step):
        run.last_checkpoint = save(run)
    if run.runtime.is_main:
        _plot(run)


def _plot(run: Run) -> None:
    plot_run(run.out / "metrics.jsonl", run.out / "plots", title=f"k3 {run.cfg.preset}")


def save(run: Run) -> Path:
    """Checkpoint `run` at its current step; every process calls it. The runtime writes the model and optimizer
    (model.safetensors, or every rank's DCP shards), then the main process adds the rest and commits atomically.
    A save that fails or is interrupted removes its `.tmp` folder, keeping the last good checkpoint; a full disk
    raises DiskFull, which says so."""
    root, step = run.out / "checkpoints", run.step
    state = {"scheduler": run.scheduler.state_dict(), "rng": _rng_state(), "step": step, "tokens": run.tokens,
             "data": run.batches.state_dict()}
    extra_files = {"config.json": json.dumps(run.model_config.to_config_json(), indent=2)}
    extra_dirs = {"tokenizer": run.out / "tokenizer"}
    tmp = root / (step_dir_name(step) + ".tmp")
    try:
        if run.runtime.is_main:
            new_checkpoint_dir(root, step)
        run.runtime.barrier()
        state.update(run.parallel.save(tmp, run.optimizer))
        run.runtime.barrier()
        if run.runtime.is_main:
            write_train_state(tmp, state, extra_files, extra_dirs)
            commit_checkpoint(root, step, tmp, run.cfg.keep_checkpoints)
    except BaseException as e:
        if run.runtime.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if disk_full(e):
            raise DiskFull(f"no space left on device for the step-{step} checkpoint in {root}: the partial "
                           f"checkpoint was removed and the last good one ({run.last_checkpoint or 'none yet'}) "
                           f"kept; free some space, then resume") from e
        raise
    run.runtime.barrier()
    return root / step_dir_name(step)


def _resume(run: Run, log) -> dict[str, Any] | None:
    """Restore `run` from its newest committed checkpoint (model, optimizer, schedule, RNG, step and token counts)
    and cut the metrics log back to that step; returns the data position to continue from (None: no checkpoint,
    the run starts over)."""
    ckpt = latest_checkpoint(run.out / "checkpoints")
    if ckpt is None:
        run.metrics_log.truncate_after(0)
        return None
    if ModelConfig.load(ckpt / "config.json") != run.model_config:
        raise CheckpointError(f"{ckpt} was written for a different model configuration")
    distributed_ckpt = (ckpt / DCP_MARKER).exists()
    if distributed_ckpt != run.parallel.distributed:
        how = "under torchrun (any number of processes)" if distributed_ckpt else "without torchrun"
        raise CheckpointError(f"{ckpt} is a {'distributed' if distributed_ckpt else 'single-process'} checkpoint: "
                              f"resume it {how}")
    if run.runtime.is_main:
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as e:
            raise CheckpointError(f"{e}; to resume from the checkpoint before it, move {ckpt.name} out of "
                                  f"{ckpt.parent}") from e
    run.runtime.barrier()
    state = torch.load(ckpt / "train_state.pt", weights_only=True)
    run.parallel.load(ckpt, run.optimizer, state)
    _load_schedule(run, state["scheduler"])
    _set_rng_state(state["rng"])
    run.step, run.tokens = state["step"], state["tokens"]
    log(f"resumed from {ckpt} (step {run.step})")
    run.metrics_log.truncate_after(run.step)
    return state["data"]


def _load_schedule(run: Run, state: dict[str, Any]) -> None:
    """The checkpoint's schedule position, on the run's current length: a resume with a new length continues
    on the cosine of that length (the checkpoint records the length it was written under)."""
    saved = [f.get("total_steps") for f in state.get("lr_lambdas", []) if f]
    for fields in state.get("lr_lambdas", []):
        if fields and "total_steps" in fields:
            fields["total_steps"] = run.total_steps
    run.scheduler.load_state_dict(state)
    if any(total != run.total_steps for total in saved):
        sched = run.scheduler
        for group, base, multiplier in zip(run.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * multiplier(sched.last_epoch)


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
