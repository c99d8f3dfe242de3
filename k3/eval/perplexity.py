"""Perplexity of held-out text through the server (`/v1/completions` with echo and prompt logprobs), in nats per
token and bits per byte, and by position in the context window (docs/evaluation.md).

Each document is tokenized by the server (`/tokenize`, no specials) and cut into windows of `window - 1` tokens,
each scored after `[BOS]`, so every token of the text is predicted exactly once and the first of a window sees no
earlier text. Bits per byte divide the same total by the text's UTF-8 bytes (times ln 2), so models with
different tokenizers compare. Position buckets are powers of two, [1, 2), [2, 4), …: how the loss falls as a
token sees more context, which is what long-context training should extend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from k3.eval.client import Client

WINDOWS_PER_REQUEST = 8


def documents(files: list[str] | None = None, run: str | None = None, tokenizer: Any = None) -> list[tuple[str, str]]:
    """(name, text) of the held-out text: the files (text, JSONL, Parquet or folders: `k3 train --data`'s
    formats), else the held-out split of a training run (its `data/heldout`, decoded with the run's tokenizer)."""
    if files:
        from k3.train.data import read_documents

        return [d for f in files for d in read_documents(f)]
    if run is not None and (Path(run) / "data" / "heldout").is_dir() and tokenizer is not None:
        from k3.train.data import TokenizedCorpus

        corpus = TokenizedCorpus.open(Path(run) / "data" / "heldout")
        out = []
        for i in range(corpus.num_documents):
            ids = [t for t in corpus.document(i).tolist() if not tokenizer.is_special(t)]
            out.append((f"{run}:heldout[{i}]", tokenizer.decode(ids)))
        return out
    raise ValueError("perplexity needs --text FILE (or a run folder as MODEL: its held-out split is used)")


def buckets(window: int) -> list[tuple[int, int]]:
    """[1, 2), [2, 4), … up to the window's last position."""
    out, a = [], 1
    while a < window:
        out.append((a, min(2 * a, window)))
        a *= 2
    return out


def run_perplexity(client: Client, docs: list[tuple[str, str]], bos_id: int, window: int = 2048,
                   max_tokens: int | None = 100_000, progress: bool = True) -> dict[str, Any]:
    """Score the documents (up to `max_tokens` tokens in all) in windows of `window` tokens.
    -> nats/token, bits/byte, perplexity, and nats/token per position bucket."""
    if window < 2:
        raise ValueError("the window must hold [BOS] and at least one token")
    model = client.model()["id"]
    spans = buckets(window)
    nll_at = [0.0] * len(spans)
    n_at = [0] * len(spans)
    total_nll, total_tokens, total_bytes, used = 0.0, 0, 0, 0
    pending: list[list[int]] = []

    def flush() -> None:
        nonlocal total_nll, total_tokens
        if not pending:
            return
        out = client.completions(model=model, prompt=pending, max_tokens=0, echo=True, logprobs=0)
        for choice in sorted(out["choices"], key=lambda c: c["index"]):
            lps = choice["logprobs"]["token_logprobs"]
            for pos in range(1, len(lps)):
                nll = -lps[pos]
                total_nll += nll
                b = pos.bit_length() - 1  # bucket [2^b, 2^(b+1))
                nll_at[b] += nll
                n_at[b] += 1
            total_tokens += len(lps) - 1
        pending.clear()

    from tqdm import tqdm

    bar = tqdm(total=max_tokens or None, desc="perplexity", unit="tok", disable=not progress)
    for _, text in docs:
        if max_tokens is not None and used >= max_tokens:
            break
        ids = client.tokenize(text)
        if max_tokens is not None and used + len(ids) > max_tokens:
            ids = ids[: max_tokens - used]
            text = client.detokenize(ids)
        if not ids:
            continue
        total_bytes += len(text.encode("utf-8"))
        used += len(ids)
        for a in range(0, len(ids), window - 1):
            pending.append([bos_id] + ids[a : a + window - 1])
            if len(pending) == WINDOWS_PER_REQUEST:
                flush()
        bar.update(len(ids))
    flush()
    bar.close()
    if total_tokens == 0:
        raise ValueError("the held-out text holds no tokens")
    nats = total_nll / total_tokens
    return {"nats_per_token": nats, "perplexity": math.exp(nats),
            "bits_per_byte": total_nll / math.log(2) / total_bytes, "tokens": total_tokens, "bytes": total_bytes,
            "window": window, "documents": len(docs),
            "by_position": [{"from": a, "to": b, "tokens": n, "nats_per_token": s / n if n else None}
                            for (a, b), s, n in zip(spans, nll_at, n_at)]}


def plot_by_position(result: dict[str, Any], path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["by_position"] if r["tokens"]]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([math.sqrt(r["from"] * r["to"]) for r in rows], [r["nats_per_token"] for r in rows], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in the window (tokens, bucket centre)")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.set_title(title or f"held-out loss by position ({result['tokens']:,} tokens, window {result['window']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
