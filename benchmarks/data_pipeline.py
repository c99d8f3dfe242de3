"""The default corpus and the data pipeline's cost on this CPU: read and split the standard library, train the
`tiny` BPE on the train split, tokenize both splits, pack batches.

Prints each step's time and the corpus's statistics (documents, characters, tokens, characters per token, the
unigram entropy that `k3 train` plots as the context-free baseline). Correctness gate: the tokenizer round-trips
the held-out documents and every packed batch has as many labels as its rows minus one per fragment.

    python benchmarks/data_pipeline.py     # tables "steps" and "corpus" of benchmarks/results/data-pipeline-cpu.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.provenance import save_result, table  # noqa: E402
from k3.config import get_preset  # noqa: E402
from k3.tokenizer import train_bpe  # noqa: E402
from k3.train.data import PackedBatches, prepare_corpus, split_documents, stdlib_documents  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batches", type=int, default=200, help="packed batches to time")
    args = ap.parse_args()
    vocab = get_preset("tiny").vocab_size

    t = time.perf_counter()
    train, heldout = split_documents(stdlib_documents())
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    tokenizer = train_bpe([text for _, text in train], vocab, show_progress=False)
    bpe_s = time.perf_counter() - t
    for _, text in heldout:  # correctness gate
        if tokenizer.decode(tokenizer.encode(text)) != text:
            raise SystemExit("correctness gate: the tokenizer does not round-trip a held-out document")
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        train_corpus = prepare_corpus(train, tokenizer, Path(tmp) / "train", show_progress=False)
        heldout_corpus = prepare_corpus(heldout, tokenizer, Path(tmp) / "heldout", show_progress=False)
        tokenize_s = time.perf_counter() - t
        batches = PackedBatches(train_corpus, args.batch_size, args.seq_len, seed=0, streams=16)
        t = time.perf_counter()
        for _, batch in zip(range(args.batches), batches):
            fragments = batch.cu_seqlens.numel() - 1
            if int((batch.labels != -100).sum()) != batch.input_ids.numel() - fragments:
                raise SystemExit("correctness gate: a packed batch has the wrong number of labels")
        pack_ms = (time.perf_counter() - t) / args.batches * 1e3
        stats = {"train_tokens": train_corpus.num_tokens, "heldout_tokens": heldout_corpus.num_tokens,
                 "entropy": train_corpus.unigram_entropy()}
    chars = sum(len(text) for _, text in train + heldout)
    tokens = stats["train_tokens"] + stats["heldout_tokens"]
    steps = [["read the standard library and split it", f"{len(train)} train / {len(heldout)} held-out", None,
              f"{read_s:.1f} s"],
             [f"train the BPE (vocabulary {vocab:,})", len(train), None, f"{bpe_s:.1f} s"],
             ["tokenize train + held-out", len(train) + len(heldout),
              f"{stats['train_tokens']:,} + {stats['heldout_tokens']:,}", f"{tokenize_s:.1f} s"],
             [f"pack one {args.batch_size} × {args.seq_len} batch (16 streams)", None, args.batch_size * args.seq_len,
              f"{pack_ms:.2f} ms"]]
    corpus = [[f"Python {sys.version.split()[0]} standard library", len(train) + len(heldout), chars, tokens,
               round(chars / tokens, 2), round(stats["entropy"], 3), len(heldout), stats["heldout_tokens"]]]
    for row in steps:
        print(" | ".join("" if v is None else str(v) for v in row))
    print(corpus[0])
    save_result("data-pipeline", "The default corpus (this Python's standard library) and the data pipeline's cost "
                "on this CPU: read and split, BPE training, tokenizing, packing",
                {"steps": table(["step", "documents", "tokens", "time"], steps),
                 "corpus": table(["corpus", "documents", "characters", "tokens", "characters per token",
                                  "unigram entropy (nats/token)", "held-out documents", "held-out tokens"], corpus)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
