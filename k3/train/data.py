"""Training data: documents in, packed `[B, T]` batches with `cu_seqlens` out (docs/data.md).

Legend: B rows per batch, T tokens per row, N documents (fragments in `cu_seqlens`), W data-parallel ranks.

    documents (name, text) ─ split_documents ─▶ train / held-out        (by a hash of the name, stable)
    prepare_corpus: [BOS] text [EOS] per document → tokens.bin (uint32) + offsets.npy   (offline, once)
    PackedBatches: a per-epoch permutation of documents → stream → rows of T tokens → Batch

Design choices worth knowing:
- The default corpus is the running Python's standard library (`.py` files, no test folders): it needs
  no download and is code, which suits K3.
- Rows are cut from one continuous document stream (epoch after epoch, no padding while training); a
  document that does not fit continues at the start of the next row as a fragment without BOS. Each
  fragment is its own `cu_seqlens` segment, and its last position has label -100, so no prediction
  crosses a row or a document boundary.
- What the loop trains on is a data source (`TextDocuments` here; conversations for `k3 sft` in
  k3.posttrain): documents by name, and how to turn them into token ids with an optional per-token loss
  mask. A corpus of whole documents (conversations) is packed without splitting any document: a row takes
  the next documents while they fit and is padded after them; documents longer than the context are left
  out when the corpus is prepared, and counted.
- The loader position is {epoch, document cursor, offset inside that document, global row}: plain ints,
  the same on every rank (rank r of W keeps the global rows ≡ r mod W), and independent of B and T.
- The shuffle is our own hash-based permutation (splitmix64 of (seed, epoch, index), then argsort), so
  it never changes with numpy or torch versions and a resumed run sees exactly the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3.checkpoint import fsync_dir

IGNORE_INDEX = -100
Document = tuple[str, str]  # (name, text); the name decides the held-out split
# A document as token ids and its loss mask (1: the token is a training target; None: every token is)
EncodedDocument = tuple[list[int], list[int] | None]


class TextDocuments:
    """The pre-training data source: text documents, each `[BOS] text [EOS]`, every token a target, packed as one
    stream (documents continue across rows). `path`: a file or folder for `read_documents`; None: the running
    Python's standard library.

    A data source is what `k3.train.loop.train` reads: `format` (recorded as `TrainConfig.data_format`),
    `whole_documents` (pack without splitting documents), `documents()` → (name, text) pairs, raising ValueError
    that names the file and line of bad input, and `encode(tokenizer, texts)` → one `EncodedDocument` per text.
    """

    format = "text"
    whole_documents = False

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = path

    def documents(self) -> list[Document]:
        return stdlib_documents() if self.path is None else read_documents(self.path)

    def encode(self, tokenizer, texts: Sequence[str]) -> list[EncodedDocument]:
        bos, eos = tokenizer.bos_id, tokenizer.document_end_id
        return [([bos, *ids, eos], None) for ids in tokenizer.encode_batch(list(texts))]


_SKIP_STDLIB_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_documents() -> list[Document]:
    """(path relative to the stdlib folder, text) of every `.py` file of this Python's standard library.

    Sorted by path. Skips `site-packages` and the test suites (`test/`, `tests/`, `idle_test/`: they
    are large, repetitive, and hold deliberately odd files) and any file that is not valid UTF-8.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_STDLIB_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        text = _read_text(path)
        if text:
            docs.append((rel.as_posix(), text))
    docs.sort(key=lambda d: d[0])
    return docs


def split_documents(docs: Sequence[Document], heldout_fraction: float = 0.02,
                    seed: int = 0) -> tuple[list[Document], list[Document]]:
    """Split into (train, held-out) by a hash of each document's name, so adding files moves no others.

    Order inside each part follows `docs`. If the hash puts no document in the held-out part although
    `heldout_fraction > 0` (tiny corpora), the document with the smallest hash is held out.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    scores = [_name_hash(seed, name) for name, _ in docs]
    held = [s < heldout_fraction for s in scores]
    if heldout_fraction > 0 and not any(held) and len(docs) >= 2:
        held[int(np.argmin(scores))] = True
    train = [d for d, h in zip(docs, held) if not h]
    heldout = [d for d, h in zip(docs, held) if h]
    return train, heldout


def _name_hash(seed: int, name: str) -> float:
    digest = hashlib.blake2b(f"{seed}\0{name}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def read_documents(path: str | os.PathLike) -> list[Document]:
    """Documents from a local file or folder.

    - `.jsonl`: one document per line, its `"text"` field; `.parquet`: the `text` column (needs pyarrow);
    - any other file: one document, if it is UTF-8 text (a folder's binary files are skipped);
    - a folder: every file below it (sorted, hidden entries and `__pycache__` skipped); a folder written
      by HF `datasets`' `save_to_disk` is read with `load_from_disk` (needs `datasets`), every split.
    Names are paths relative to `path` (plus `:line` / `:row` / `split/index`). Missing path or no
    documents → ValueError.
    """
    root = Path(path)
    if not root.exists():
        raise ValueError(f"data path {str(path)!r} does not exist")
    if root.is_dir() and _is_hf_dataset(root):
        docs = _read_hf_dataset(root)
    elif root.is_dir():
        docs = []
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = file.relative_to(root)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            docs.extend(_read_file(file, rel.as_posix(), strict=False))
    else:
        docs = _read_file(root, root.name, strict=True)
    if not docs:
        raise ValueError(f"no documents found in {str(path)!r} (empty, or no UTF-8 text / jsonl / parquet in it)")
    return docs


def _read_file(file: Path, name: str, strict: bool) -> list[Document]:
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        docs = []
        with open(file, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{file}:{lineno}: not valid UTF-8 (byte {e.start} of the line)") from e
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{file}:{lineno}: expected a JSON object with a \"text\" field") from e
                if not isinstance(text, str):
                    raise ValueError(f"{file}:{lineno}: \"text\" must be a string")
                if text:
                    docs.append((f"{name}:{lineno}", text))
        return docs
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ValueError(f"reading {file} needs pyarrow: pip install 'k3[data]'") from e
        return _read_parquet(file, name, pq)
    text = _read_text(file)
    if text is None and strict:
        raise ValueError(f"{file} is not UTF-8 text")
    return [(name, text)] if text else []


def _read_parquet(file: Path, name: str, pq) -> list[Document]:
    """The `text` column, row group by row group, so that a damaged file is reported with the group that fails."""
    try:
        parquet = pq.ParquetFile(file)
    except Exception as e:  # pyarrow raises its own error types for a damaged file
        raise ValueError(f"{file}: not a readable Parquet file ({e})") from e
    names = parquet.schema_arrow.names
    if "text" not in names:
        raise ValueError(f"{file} has no 'text' column (columns: {names})")
    docs, row = [], 0
    for group in range(parquet.num_row_groups):
        try:
            column = parquet.read_row_group(group, columns=["text"]).column("text").to_pylist()
        except Exception as e:
            raise ValueError(f"{file}: row group {group} cannot be read ({e})") from e
        for text in column:
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{file}: row {row} (row group {group}): 'text' must be a string, "
                                 f"got {type(text).__name__}")
            if text:
                docs.append((f"{name}:{row}", text))
            row += 1
    return docs


def _read_text(file: Path) -> str | None:
    """The file's text, or None if it is binary (a NUL byte) or not valid UTF-8."""
    data = file.read_bytes()
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _is_hf_dataset(folder: Path) -> bool:
    # what `save_to_disk` writes: dataset_dict.json for a DatasetDict, state.json + dataset_info.json for one split
    return (folder / "dataset_dict.json").is_file() or all(
        (folder / f).is_file() for f in ("state.json", "dataset_info.json"))


def _read_hf_dataset(folder: Path) -> list[Document]:
    try:
        import datasets
    except ImportError as e:
        raise ValueError(f"{folder} is a Hugging Face datasets folder; reading it needs `pip install datasets`") from e
    loaded = datasets.load_from_disk(str(folder))
    splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
    docs = []
    for split, ds in sorted(splits, key=lambda kv: kv[0]):
        if "text" not in ds.column_names:
            raise ValueError(f"{folder}: split {split or '(single)'} has no 'text' column ({ds.column_names})")
        prefix = f"{split}/" if split else ""
        docs.extend((f"{prefix}{i}", text) for i, text in enumerate(ds["text"]) if text)
    return docs


def documents_fingerprint(documents: Iterable[Document | str]) -> str:
    """A hash of the documents' texts in order: with the tokenizer's fingerprint, decides if a prepared
    corpus can be reused."""
    h = hashlib.sha256()
    for doc in documents:
        text = doc[1] if isinstance(doc, tuple) else doc
        data = text.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def prepare_corpus(documents: Sequence[Document | str], tokenizer, directory: str | os.PathLike,
                   show_progress: bool = True, *, source=None, max_document_tokens: int | None = None
                   ) -> TokenizedCorpus:
    """Tokenize every document into `directory` (replacing it atomically): as [BOS] tokens [EOS], or as the
    data `source` encodes it (default `TextDocuments`).

    Writes `tokens.bin` (uint32, all documents back to back), `offsets.npy` (int64 [N+1], document i is
    tokens[offsets[i]:offsets[i+1]]), `loss_mask.bin` (uint8 per token, only when the source gives masks) and
    `meta.json`, into a temporary folder that is then renamed. `tokenizer`: a `k3.tokenizer.Tokenizer`. Empty
    texts are skipped; so are documents of more than `max_document_tokens` tokens, whose names `meta.json` lists
    under "skipped".
    """
    source = TextDocuments() if source is None else source
    docs = [doc if isinstance(doc, tuple) else (str(i), doc) for i, doc in enumerate(documents)]
    docs = [doc for doc in docs if doc[1]]
    if not docs:
        raise ValueError("prepare_corpus got no non-empty documents")
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_corpus(docs, tokenizer, tmp, show_progress, source, max_document_tokens)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # an error or a stop: leave nothing half-written
        raise
    old = directory.parent / f".{directory.name}.old-{os.getpid()}"
    if directory.exists():
        os.replace(directory, old)
    os.replace(tmp, directory)
    fsync_dir(directory.parent)
    shutil.rmtree(old, ignore_errors=True)
    return TokenizedCorpus.open(directory)


def remove_unfinished_corpora(folder: str | os.PathLike) -> list[str]:
    """Remove what a killed `prepare_corpus` left in `folder` (its `.NAME.tmp-PID` / `.NAME.old-PID` folders);
    returns their names. Only while no other process prepares there."""
    folder = Path(folder)
    found = sorted(folder.glob(".*.tmp-*")) + sorted(folder.glob(".*.old-*")) if folder.is_dir() else []
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in found]


def _write_corpus(docs: list[Document], tokenizer, tmp: Path, show_progress: bool, source,
                  max_document_tokens: int | None) -> None:
    from tqdm.auto import tqdm

    texts = [text for _, text in docs]
    lengths: list[int] = []
    skipped: list[str] = []
    masks = None  # loss_mask.bin, opened at the first document that has a mask
    written = 0  # tokens in tokens.bin so far
    with open(tmp / "tokens.bin", "wb") as f, tqdm(total=len(texts), unit="doc", desc="tokenizing",
                                                    disable=not show_progress) as bar:
        try:
            start = 0
            # batches of ~8M characters keep the Rust tokenizer's threads busy and the progress bar moving
            while start < len(texts):
                stop, chars = start, 0
                while stop < len(texts) and (stop == start or chars < 8_000_000):
                    chars += len(texts[stop])
                    stop += 1
                flat: list[int] = []
                flat_mask: list[int] = []
                for k, (ids, mask) in enumerate(source.encode(tokenizer, texts[start:stop])):
                    if max_document_tokens is not None and len(ids) > max_document_tokens:
                        skipped.append(docs[start + k][0])
                        continue
                    if mask is not None and masks is None:
                        masks = open(tmp / "loss_mask.bin", "wb")
                        # every document before this one has no mask: all its tokens are targets
                        masks.write(np.ones(written + len(flat), dtype=np.uint8).tobytes())
                    assert mask is None or len(mask) == len(ids), "a loss mask needs one entry per token"
                    flat.extend(ids)
                    if masks is not None:
                        flat_mask.extend([1] * len(ids) if mask is None else mask)
                    lengths.append(len(ids))
                f.write(np.asarray(flat, dtype=np.uint32).tobytes())
                written += len(flat)
                if masks is not None:
                    masks.write(np.asarray(flat_mask, dtype=np.uint8).tobytes())
                bar.update(stop - start)
                start = stop
            f.flush()
            os.fsync(f.fileno())
            if masks is not None:
                masks.flush()
                os.fsync(masks.fileno())
        finally:
            if masks is not None:
                masks.close()
    if not lengths:
        raise ValueError(f"every document is longer than {max_document_tokens} tokens (the context): nothing to "
                         f"train on; use a longer context or shorter documents")

    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    with open(tmp / "offsets.npy", "wb") as f:
        np.save(f, offsets)
        f.flush()
        os.fsync(f.fileno())
    meta = {
        "format": 1,
        "num_documents": len(lengths),
        "num_tokens": int(offsets[-1]),
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "document_end_id": tokenizer.document_end_id,
        "pad_id": tokenizer.pad_id,
        "tokenizer": tokenizer.fingerprint(),
        "documents": documents_fingerprint(texts),
        "data_format": source.format,
        "whole_documents": bool(source.whole_documents),
        "loss_mask": masks is not None,
        "skipped": skipped,  # longer than max_document_tokens
    }
    with open(tmp / "meta.json", "w") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


class TokenizedCorpus:
    """A prepared corpus: `tokens` (uint32 memmap [num_tokens]), `offsets` (int64 [N+1]), `meta` (dict),
    `loss_mask` (uint8 memmap [num_tokens], 1 = a training target; None: every token is), and whether its
    documents are packed whole (`whole_documents`)."""

    def __init__(self, directory: Path, tokens: np.ndarray, offsets: np.ndarray, meta: dict[str, Any],
                 loss_mask: np.ndarray | None = None):
        self.directory = directory
        self.tokens = tokens
        self.offsets = offsets
        self.meta = meta
        self.loss_mask = loss_mask
        self.whole_documents = bool(meta.get("whole_documents", False))
        # a multimodal corpus: each document's images in the order of its pads (set from its data source,
        # k3.vision.data.MultimodalRows; the batches attach them, k3.vision.data.MediaBatches); None: text only
        self.media: list | None = None

    @classmethod
    def open(cls, directory: str | os.PathLike) -> TokenizedCorpus:
        directory = Path(directory)
        files = [directory / n for n in ("meta.json", "offsets.npy", "tokens.bin")]
        if not all(f.is_file() for f in files):
            raise ValueError(f"{directory} is not a prepared corpus (needs meta.json, offsets.npy, tokens.bin)")
        try:
            meta = json.loads(files[0].read_text())
            offsets = np.load(files[1])
        except ValueError as e:  # JSONDecodeError, or a damaged .npy header
            raise ValueError(f"{directory}: unreadable meta.json / offsets.npy ({e}); corrupted corpus?") from e
        size = files[2].stat().st_size
        n = meta["num_tokens"]
        if (offsets.ndim != 1 or len(offsets) != meta["num_documents"] + 1 or offsets[0] != 0
                or offsets[-1] != n or size != 4 * n or bool((np.diff(offsets) <= 0).any())):
            raise ValueError(f"{directory}: tokens.bin / offsets.npy / meta.json disagree (corrupted corpus?)")
        tokens = np.memmap(files[2], dtype=np.uint32, mode="r", shape=(n,))
        loss_mask = None
        if meta.get("loss_mask"):
            mask_file = directory / "loss_mask.bin"
            if not mask_file.is_file() or mask_file.stat().st_size != n:
                raise ValueError(f"{directory}: loss_mask.bin is missing or does not match tokens.bin (corrupted "
                                 f"corpus?)")
            loss_mask = np.memmap(mask_file, dtype=np.uint8, mode="r", shape=(n,))
        return cls(directory, tokens, offsets, meta, loss_mask)

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def __len__(self) -> int:
        return self.num_documents

    def document(self, i: int) -> np.ndarray:
        """Document i's tokens, [BOS] … [EOS] (uint32 view)."""
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def unigram_entropy(self) -> float:
        """Entropy (nats/token) of the corpus's target-token frequencies (every token, or those of the loss mask):
        the loss of the best context-free model."""
        targets = np.asarray(self.tokens) if self.loss_mask is None else np.asarray(self.tokens)[self.loss_mask == 1]
        counts = np.bincount(targets, minlength=self.meta["vocab_size"]).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


@dataclass
class Batch:
    input_ids: torch.Tensor   # [B, T] int64
    labels: torch.Tensor      # [B, T] int64; -100 = no loss at this position
    cu_seqlens: torch.Tensor  # [N+1] int64, offsets into the flattened B·T tokens; every row end is one
    num_tokens: int           # labelled positions in this batch (labels != -100)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(self.input_ids.to(device, non_blocking=non_blocking),
                     self.labels.to(device, non_blocking=non_blocking),
                     self.cu_seqlens.to(device, non_blocking=non_blocking), self.num_tokens)


def document_permutation(num_documents: int, seed: int, epoch: int) -> np.ndarray:
    """The order of documents in `epoch`: argsort of a splitmix64 hash of (seed, epoch, index)."""
    key = _splitmix64_int((seed * 0x9E3779B97F4A7C15 + epoch) & _MASK64)
    x = np.arange(num_documents, dtype=np.uint64) ^ np.uint64(key)
    return np.argsort(_splitmix64(x), kind="stable")


_MASK64 = (1 << 64) - 1


def _splitmix64_int(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class PackedBatches:
    """An iterator of `Batch`es of B rows × T tokens cut from the document stream.

    Training (`shuffle=True, loop=True`, the default): documents in a per-epoch permutation from `seed`,
    epoch after epoch without end; rows are always full. The permutation is dealt into `streams`
    interleaved streams (stream s reads documents s, s + S, s + 2S, … of it) and global row i is cut from
    stream i mod S, so the rows of one batch come from different documents even when documents are much
    longer than a row (one long file would otherwise fill whole batches: correlated, noisy steps). Each
    stream moves to its next epoch's permutation on its own. Evaluation (`PackedBatches.eval`): documents in
    corpus order, once; the last row is completed with `[PAD]` (its own segment, labels -100) and the last
    batch with all-`[PAD]` rows, so every held-out token is scored exactly once.

    With W data-parallel ranks, rank r keeps the global rows ≡ r (mod W): batch k of rank r is global rows
    k·B·W + r + j·W, j < B. `state_dict()` is the position after the last batch returned, identical on all
    ranks; `load_state_dict` makes a fresh iterator continue exactly there (also at another W, B or T).

    A corpus of whole documents (`TokenizedCorpus.whole_documents`, e.g. conversations) is packed without
    splitting any document: a row takes its stream's next documents while they fit, and the rest of the row is
    one `[PAD]` segment with no labels; every document must fit in a row. A corpus with a loss mask labels only
    its target tokens: position t's label is token t+1 if the mask marks t+1, else -100.
    """

    def __init__(self, corpus: TokenizedCorpus, batch_size: int, seq_len: int, *, seed: int = 0,
                 shuffle: bool = True, loop: bool = True, rank: int = 0, world_size: int = 1, streams: int = 1):
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        need = batch_size * seq_len * world_size
        longest = int(np.diff(corpus.offsets).max())
        if corpus.whole_documents and longest > seq_len:
            raise ValueError(f"the corpus packs whole documents and its longest has {longest:,} tokens, more than a "
                             f"row of {seq_len:,}: use a context of at least {longest:,} tokens")
        if loop and not corpus.whole_documents and corpus.num_tokens < need:
            raise ValueError(f"the corpus has {corpus.num_tokens:,} tokens, fewer than one batch "
                             f"({batch_size} × {seq_len}{f' × {world_size} ranks' if world_size > 1 else ''}"
                             f" = {need:,}); use more data or a smaller batch / sequence length")
        self.corpus = corpus
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.loop = loop
        self.rank = rank
        self.world_size = world_size
        self.pad_id = int(corpus.meta["pad_id"])
        self._lengths = np.diff(corpus.offsets)
        # one stream per document at most; evaluation reads the corpus in order (one stream)
        self.streams = min(streams, corpus.num_documents) if (shuffle and loop) else 1
        self._orders: dict[int, np.ndarray] = {}
        self._positions = [[0, 0, 0] for _ in range(self.streams)]  # per stream: epoch, index, offset
        self._row = 0
        self.last_documents: list[list[int]] = []  # per row of the last batch: its documents (fragments), in order

    @classmethod
    def eval(cls, corpus: TokenizedCorpus, batch_size: int, seq_len: int, *, rank: int = 0,
             world_size: int = 1) -> PackedBatches:
        """One deterministic pass over `corpus` in its own order (for held-out evaluation)."""
        return cls(corpus, batch_size, seq_len, shuffle=False, loop=False, rank=rank, world_size=world_size)

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        """Batches per rank in one full pass (evaluation mode only)."""
        if self.loop:
            raise TypeError("a looping PackedBatches has no length")
        return -(-self.rows_per_epoch() // (self.batch_size * self.world_size))

    def rows_per_epoch(self) -> int:
        """Global rows that one pass over the corpus fills (of epoch 0's order, for whole documents)."""
        if not self.corpus.whole_documents:
            return -(-self.corpus.num_tokens // self.seq_len)
        rows = 0
        for stream in range(self.streams):
            filled = self.seq_len
            for doc in self._stream_order(0, stream):
                length = int(self._lengths[doc])
                if filled + length > self.seq_len:
                    rows, filled = rows + 1, 0
                filled += length
        return rows

    @property
    def epoch(self) -> int:
        """The epoch every stream has reached (streams move on to the next permutation on their own)."""
        return min(p[0] for p in self._positions)

    def order(self, epoch: int) -> np.ndarray:
        """Document indices in the order epoch `epoch` visits them (before dealing into streams)."""
        if not self.shuffle:
            return np.arange(self.corpus.num_documents)
        return document_permutation(self.corpus.num_documents, self.seed, epoch)

    def _stream_order(self, epoch: int, stream: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) > 4 * self.streams + 4:  # streams sit in at most a few epochs at once
                self._orders.clear()
            self._orders[epoch] = self.order(epoch)
        return self._orders[epoch][stream::self.streams]

    def state_dict(self) -> dict:
        return {"streams": self.streams, "positions": [list(p) for p in self._positions], "row": self._row,
                "seed": self.seed, "shuffle": int(self.shuffle), "num_documents": self.corpus.num_documents,
                "num_tokens": self.corpus.num_tokens}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "shuffle", "num_documents", "num_tokens"):
            if int(state[key]) != mine[key]:
                raise ValueError(f"loader state does not fit this data: {key} is {state[key]} in the state, "
                                 f"{mine[key]} here (different corpus or seed?)")
        if "positions" in state:
            streams, positions = int(state["streams"]), [[int(x) for x in p] for p in state["positions"]]
        else:  # a state written before streams existed: one stream, continued exactly
            streams, positions = 1, [[int(state["epoch"]), int(state["document"]), int(state["offset"])]]
        if streams != len(positions) or not 1 <= streams <= max(1, self.corpus.num_documents):
            raise ValueError(f"loader state points outside the corpus: {state}")
        self.streams, self._orders = streams, {}
        for s_, (epoch, index, offset) in enumerate(positions):
            docs = self._stream_order(epoch, s_) if epoch >= 0 else []
            inside = 0 <= index < len(docs) and 0 <= offset < self._lengths[docs[index]]
            if epoch < 0 or not (inside or (index == len(docs) and offset == 0)):
                raise ValueError(f"loader state points outside the corpus: {state}")
        self._positions, self._row = positions, int(state["row"])

    def _exhausted(self) -> bool:
        """A single pass (evaluation) is over."""
        epoch, index, _ = self._positions[0]
        return not self.loop and index == len(self._stream_order(epoch, 0))

    def _next_row(self) -> list[tuple[int, int]]:
        """Advance by one global row (from stream row mod S): its fragments as (start, end) token ranges.

        Fewer than T tokens only at the end of a single pass (eval); empty once the pass is over."""
        fragments, filled, T = [], 0, self.seq_len
        stream = self._row % self.streams
        position = self._positions[stream]
        while filled < T:
            epoch, index, offset = position
            docs = self._stream_order(epoch, stream)
            if index == len(docs):
                if not self.loop:
                    break
                position[:] = [epoch + 1, 0, 0]
                continue
            doc = int(docs[index])
            length = int(self._lengths[doc])
            if self.corpus.whole_documents and length > T - filled:
                break  # the next document starts the next row (every one fits a row: checked in __init__)
            take = min(length - offset, T - filled)
            start = int(self.corpus.offsets[doc]) + offset
            fragments.append((start, start + take))
            filled += take
            position[:] = [epoch, index + 1, 0] if offset + take == length else [epoch, index, offset + take]
        self._row += 1
        return fragments

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._exhausted():
            raise StopIteration
        B, T, W = self.batch_size, self.seq_len, self.world_size
        ids = np.empty((B, T), dtype=np.int64)
        labels = np.empty((B, T), dtype=np.int64)
        cu = [0]
        self.last_documents = []
        for b in range(B):
            for g in range(W):
                fragments = self._next_row()
                if g == self.rank:
                    row_fragments = fragments
            self._fill_row(row_fragments, ids[b], labels[b], cu, b * T)
            starts = np.asarray([start for start, _ in row_fragments], dtype=np.int64)
            self.last_documents.append((np.searchsorted(self.corpus.offsets, starts, "right") - 1).tolist())
        cu_seqlens = torch.tensor(cu, dtype=torch.int64)
        num_tokens = int((labels != IGNORE_INDEX).sum())
        return Batch(torch.from_numpy(ids), torch.from_numpy(labels), cu_seqlens, num_tokens)

    def _fill_row(self, fragments: list[tuple[int, int]], ids: np.ndarray, labels: np.ndarray,
                  cu: list[int], row_start: int) -> None:
        """Write one row's tokens and labels: label t = token t+1 of the same fragment, last one -100."""
        pos = 0
        mask = self.corpus.loss_mask
        for start, end in fragments:
            n = end - start
            piece = self.corpus.tokens[start:end]
            ids[pos:pos + n] = piece
            labels[pos:pos + n - 1] = piece[1:]
            labels[pos + n - 1] = IGNORE_INDEX
            if mask is not None:
                labels[pos:pos + n - 1][mask[start + 1:end] == 0] = IGNORE_INDEX
            pos += n
            cu.append(row_start + pos)
        if pos < self.seq_len:
            # the end of a single pass, or whole documents: the rest of the row is one [PAD] segment with no labels
            ids[pos:] = self.pad_id
            labels[pos:] = IGNORE_INDEX
            cu.append(row_start + self.seq_len)
