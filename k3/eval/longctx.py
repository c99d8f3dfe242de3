"""Long-context retrieval through the server and the engine: passkey and needle-in-a-haystack prompts at lengths
from 1K tokens up to the model's context and at several depths, scored by whether the greedy answer starts with
the hidden number, drawn as a length × depth heat map (docs/evaluation.md).

- `passkey` (Mohtashami & Jaggi, 2023): an instruction, a repeated filler sentence, at the depth "The pass key is
  K. Remember it. K is the pass key.", then "What is the pass key? The pass key is".
- `needle` (after Kamradt's needle in a haystack): a haystack of real text (files, default this Python's standard
  library sources, the corpus `k3 train` reads by default), at the depth a line `magic_number = K`, then
  `assert magic_number == `. A line of Python reads naturally in code and in prose, so the same probe suits a
  code model and a general one.

Lengths are in tokens of the server's tokenizer (measured with `/tokenize`, the prompt cut at a sentence or line
boundary so that it holds at most that many); depth 0 puts the needle first, 1 last.
"""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3.eval.client import Client

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.\n\n")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
NEEDLE_LINE = "\nmagic_number = {key}\n"
NEEDLE_QUESTION = "\nassert magic_number == "
KINDS = ("passkey", "needle")
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
ANSWER_TOKENS = 8


@dataclass
class Probe:
    kind: str
    length: int  # target prompt length in tokens ([BOS] included)
    depth: float
    key: str
    prompt: str


def default_lengths(max_context: int, cap: int | None = None) -> list[int]:
    """1K, 2K, 4K, … up to the context (less the answer's tokens), or to `cap`."""
    top = max_context - ANSWER_TOKENS - 1 if cap is None else min(cap, max_context - ANSWER_TOKENS - 1)
    lengths, n = [], 1024
    while n <= top:
        lengths.append(n)
        n *= 2
    if not lengths:
        raise ValueError(f"the context ({max_context} tokens) is shorter than the shortest probe (1024)")
    return lengths


def haystack_text(files: list[str] | None, min_chars: int) -> str:
    """The needle's haystack: the files' text (a folder: its documents), else the standard library sources, in
    order, repeated until it holds `min_chars` characters."""
    from k3.train.data import read_documents, stdlib_documents

    docs = [t for f in files for _, t in read_documents(f)] if files else [t for _, t in stdlib_documents()]
    text, out = "\n".join(docs), []
    if not text.strip():
        raise ValueError("the haystack files hold no text")
    size = 0
    while size < min_chars:
        out.append(text)
        size += len(text)
    return "".join(out)


class ProbeBuilder:
    """Builds prompts of a target token length. `count(text)` is the server's token count (no [BOS])."""

    def __init__(self, kind: str, count, haystack: str | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown probe kind {kind!r}; choose one of {KINDS}")
        self.kind = kind
        self.count = count
        if kind == "passkey":
            self.head, self.question, self.needle = PASSKEY_INTRO, PASSKEY_QUESTION, PASSKEY_NEEDLE
            self.boundary = ". "
        else:
            self.head, self.question, self.needle = "", NEEDLE_QUESTION, NEEDLE_LINE
            self.boundary = "\n"
        self.haystack = haystack
        self._ratio: float | None = None  # characters per token of the filler, measured once

    def filler(self, chars: int) -> str:
        if self.kind == "passkey":
            return PASSKEY_FILLER * (chars // len(PASSKEY_FILLER) + 1)
        assert self.haystack is not None and len(self.haystack) >= chars, "haystack shorter than the probe"
        return self.haystack[: chars + 1]

    def cut(self, text: str, chars: int) -> str:
        """text[:chars] ended just after the last boundary (a sentence or a line)."""
        end = text.rfind(self.boundary, 0, chars)
        return text[: end + len(self.boundary)] if end > 0 else text[:chars]

    def assemble(self, body: str, depth: float, key: str) -> str:
        """The needle after the last boundary at or before `depth` of the body (at its start if there is none)."""
        end = body.rfind(self.boundary, 0, round(depth * len(body)) + len(self.boundary))
        at = len(body) if depth >= 1 else (end + len(self.boundary) if end >= 0 else 0)
        return self.head + body[:at] + self.needle.format(key=key) + body[at:] + self.question

    def build(self, length: int, depth: float, key: str) -> Probe:
        """A prompt of at most `length` tokens with [BOS] (as near to it as the boundaries allow)."""
        fixed = 1 + self.count(self.head + self.needle.format(key=key) + self.question)
        room = length - fixed
        if room < 16:
            raise ValueError(f"a {length}-token probe leaves no room for filler")
        if self._ratio is None:
            sample = self.filler(20000)[:20000]
            self._ratio = len(sample) / max(1, self.count(sample))
        chars = int(room * self._ratio)
        for _ in range(6):  # a few proportional corrections; BPE merges make the count slightly nonlinear
            body = self.cut(self.filler(chars), chars)
            total = fixed + self.count(body)
            if total <= length and total >= length - max(16, length // 100):
                break
            chars = max(1, int(chars * (room / max(1, total - fixed)) * (0.995 if total > length else 1.0)))
        while fixed + self.count(body) > length:
            body = self.cut(body, int(len(body) * 0.99))
        return Probe(self.kind, length, depth, key, self.assemble(body, depth, key))


def answer(text: str) -> str | None:
    """The first run of digits in the reply."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def run_retrieval(client: Client, kind: str, lengths: list[int], depths: tuple[float, ...] = DEFAULT_DEPTHS,
                  samples: int = 3, haystack_files: list[str] | None = None, seed: int = 0,
                  num_concurrent: int = 2, progress: bool = True) -> dict[str, Any]:
    """Accuracy of `kind` probes at each (length, depth): `samples` keys per cell, greedy answers of
    ANSWER_TOKENS tokens. -> {"lengths", "depths", "accuracy" [depth][length], "cells": [...]}."""
    model = client.model()["id"]
    rng = random.Random(seed)
    haystack = haystack_text(haystack_files, int(max(lengths) * 8)) if kind == "needle" else None
    builder = ProbeBuilder(kind, lambda text: len(client.tokenize(text)), haystack)
    probes = [builder.build(n, d, str(rng.randint(10000, 99999))) for n in lengths for d in depths
              for _ in range(samples)]

    def ask(probe: Probe) -> dict[str, Any]:
        out = client.completions(model=model, prompt=probe.prompt, max_tokens=ANSWER_TOKENS, temperature=0)
        reply = out["choices"][0]["text"]
        return {"length": probe.length, "depth": probe.depth, "key": probe.key, "reply": reply,
                "prompt_tokens": out["usage"]["prompt_tokens"], "correct": answer(reply) == probe.key}

    from tqdm import tqdm

    with ThreadPoolExecutor(num_concurrent) as pool:
        cells = list(tqdm(pool.map(ask, probes), total=len(probes), desc=kind, disable=not progress))
    accuracy = [[sum(c["correct"] for c in cells if c["length"] == n and c["depth"] == d) / samples
                 for n in lengths] for d in depths]
    return {"kind": kind, "lengths": list(lengths), "depths": list(depths), "samples": samples,
            "accuracy": accuracy, "mean_accuracy": sum(c["correct"] for c in cells) / len(cells), "cells": cells}


def plot_heatmap(result: dict[str, Any], path: str | Path, title: str = "") -> None:
    """Accuracy by length (columns) × depth (rows), annotated, red 0 → green 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc, lengths, depths = result["accuracy"], result["lengths"], result["depths"]
    fig, ax = plt.subplots(figsize=(1.1 * len(lengths) + 2.5, 0.6 * len(depths) + 1.8))
    im = ax.imshow(acc, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{acc[i][j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy")
    ax.set_title(title or f"{result['kind']}: retrieval accuracy ({result['samples']} per cell)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
