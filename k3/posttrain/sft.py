"""`k3 sft`: supervised fine-tuning of a trained run on conversations, through the `k3 train` loop.

SFT is the training loop (`k3.train.loop.train`) with three settings of its own, none a special case in the loop:
- `init_from`: the model config, weights (Quantile Balancing biases included) and tokenizer of the run it starts
  from; the optimizer starts fresh, with its own warmup and cosine decay;
- a data source of conversations (`Conversations`): each JSONL line rendered by the server's chat template with
  its loss mask (`k3.posttrain.conversations`), packed whole into rows with `cu_seqlens` boundaries (never split
  across rows; longer than the context → left out and counted), so only the tokens the model writes are targets;
- SFT's own defaults (`SFT_DEFAULTS`): a lower learning rate, one context stage at the base run's final length.
Conversations with `image_url` parts are read by `k3.vision.data.MultimodalRows` instead (data format
"multimodal"): the model gains its vision tower and projector (from scratch when the base run has none) and they
train with it (docs/vision.md).

Everything else is `k3 train`'s: resume, metrics.jsonl and plots, atomic checkpoints that `k3.checkpoint.load_trained`
loads (so `k3 generate`, `k3 serve` and `k3 rl --from` take an SFT run), stop signals and exit codes. The run
evaluates the starting weights before its first step, so the held-out loss shows where SFT began.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from k3.chat.template import ChatTemplate
from k3.checkpoint import resolve_checkpoint
from k3.posttrain.conversations import ConversationError, parse_line, read_conversations, render_conversation
from k3.runfolder import StopSignals
from k3.tokenizer import Tokenizer
from k3.train.config import ContextStage, TrainConfig
from k3.train.data import Document, EncodedDocument

# SFT's defaults where they differ from TrainConfig's (the base run's context length comes from its run.json)
SFT_DEFAULTS: dict[str, Any] = {
    "lr": 2e-3,  # a third of the tiny preset's pre-training peak: fine-tuning, not learning from scratch
    "warmup_frac": 0.05,
    "eval_every": 25,
    "checkpoint_every": 50,
    "heldout_fraction": 0.05,
}
# SFT packs rows of at least this many tokens: the generated set's longest conversations (tool use at max effort)
# exceed the tiny preset's final 512; NoPE attention and KDA carry a model past its training length
MIN_SEQ_LEN = 1024


class Conversations:
    """The data source of `k3 sft` (the interface of `k3.train.data.TextDocuments`): the conversations of a JSONL
    file, validated in full when read (every line rendered once, so errors name the line before anything trains),
    each a document named by its `id` (else FILE:LINE) and encoded as (ids, loss mask)."""

    format = "conversations"
    whole_documents = True

    def __init__(self, path: str | os.PathLike, tokenizer: Tokenizer):
        self.path = path
        self.template = ChatTemplate(tokenizer)

    def documents(self) -> list[Document]:
        docs = []
        for where, conversation in read_conversations(self.path):
            try:
                render_conversation(self.template, conversation)
            except ConversationError as e:
                raise ConversationError(f"{where}: {e}") from e
            docs.append((conversation.id or where, json.dumps(conversation.to_json(), ensure_ascii=False)))
        return docs

    def encode(self, tokenizer: Tokenizer, texts: Sequence[str]) -> list[EncodedDocument]:
        template = self.template if tokenizer is self.template.tokenizer else ChatTemplate(tokenizer)
        encoded = []
        for text in texts:
            rendered = render_conversation(template, parse_line(text, "a conversation"))
            encoded.append((rendered.ids, rendered.loss_mask))
        return encoded


def base_run_settings(init_from: str | os.PathLike) -> dict[str, Any]:
    """What an SFT run takes from the run it starts from: its preset's name and a context of its final one or
    `MIN_SEQ_LEN`, whichever is longer (from the run.json beside the checkpoint; "tiny" and `MIN_SEQ_LEN` when the
    checkpoint stands alone). Raises CheckpointError."""
    ckpt = resolve_checkpoint(init_from)
    run_json = ckpt.parent.parent / "run.json"
    settings: dict[str, Any] = {"preset": "tiny", "seq_len": MIN_SEQ_LEN}
    if run_json.is_file():
        stored = json.loads(run_json.read_text())["train_config"]
        settings = {"preset": stored["preset"], "seq_len": max(MIN_SEQ_LEN, stored["stages"][-1]["seq_len"])}
    return settings


def sft_config(init_from: str, data: str, out: str, seq_len: int | None = None, preset: str | None = None,
               **overrides: Any) -> TrainConfig:
    """The `TrainConfig` of an SFT run: `SFT_DEFAULTS`, then `overrides` (TrainConfig fields; None = default).
    `seq_len`: the one context stage, and `preset`: the name the run goes by (defaults: `base_run_settings`); the
    model itself is always the checkpoint's."""
    if seq_len is None or preset is None:
        base = base_run_settings(init_from)
        seq_len, preset = seq_len or base["seq_len"], preset or base["preset"]
    from k3.vision.data import MultimodalRows

    # conversations with image_url parts (or image rows) train the vision tower too (k3.vision.data)
    data_format = MultimodalRows.format if data and MultimodalRows.holds_media(data) else Conversations.format
    cfg = TrainConfig(preset=preset, data=data, data_format=data_format, init_from=init_from, out=out,
                      stages=[ContextStage(seq_len, 1.0)], **SFT_DEFAULTS)
    return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def sft(cfg: TrainConfig, resume: bool | Literal["auto"] = False, log=print, progress: bool = True,
        stop: StopSignals | None = None):
    """Train (or resume) the SFT run `cfg` (see `sft_config`); returns the loop's `RunSummary`. Raises ValueError
    (e.g. `ConversationError` naming the line) for bad data or settings, as `k3.train.loop.train` does."""
    from k3.train.loop import train

    if cfg.init_from is None:
        raise ValueError("an SFT run starts from a trained run: give --from RUN")
    run_tokenizer = Path(cfg.out) / "tokenizer"
    if (Path(cfg.out) / "run.json").exists() and run_tokenizer.is_dir():
        tokenizer = Tokenizer.load(run_tokenizer)
    else:
        tokenizer = Tokenizer.load(resolve_checkpoint(cfg.init_from) / "tokenizer")
    if cfg.data_format == "multimodal":
        from k3.vision.data import MultimodalRows

        source = MultimodalRows(cfg.data)
    else:
        source = Conversations(cfg.data, tokenizer)
    return train(cfg, resume=resume, log=log, progress=progress, stop=stop, source=source)


def stored_config(out: str | os.PathLike) -> TrainConfig | None:
    """The settings of the run in `out` (None: no run there): a resume starts from them, so it needs only --out."""
    run_json = Path(out) / "run.json"
    if not run_json.is_file():
        return None
    try:
        return TrainConfig.from_dict(json.loads(run_json.read_text())["train_config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{run_json} cannot be read ({e}); the run folder is damaged") from e
