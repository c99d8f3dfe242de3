"""Multimodal training data: JSONL rows with images → packed `[B, T]` batches with their pixels (docs/vision.md).

Legend: B rows per batch, T tokens per row, N patches, n media items.

Rows of a `.jsonl` file (image paths relative to the file, or `data:image/...;base64,` URLs; never network URLs):
- `{"image": PATH, "text": ...}` (also `"images": [...]`, or `"video": [frame, ...]` for one item of ≤ 4 frames):
  `[BOS]` + each item's media prompt + the text + `[EOS]`; the loss is on the text and `[EOS]`.
- `{"messages": [...]}`: an OpenAI-style conversation whose content parts may be `{"type": "image_url",
  "image_url": {"url": ...}}`; rendered by `k3.chat.template` with each image's media prompt where it stands, the
  loss on what the assistant writes (its channels and `<|end_of_msg|>`).
- `{"text": ...}` alone: a text document. Other keys (e.g. the generator's `question` / `answer`) are ignored.

Reading tokenizes every row and reads each image's size from its header (no pixel decode), so the packing plan
is known up front: `MultimodalBatches` fills rows with whole samples in a per-epoch shuffled order (a sample never
splits across rows; the rest of a row is one `[PAD]` segment without labels) and its loader workers decode,
resize and patchify the images of each batch (`loader_workers` processes, batches in order). The position is
{epoch, cursor} — plain ints in the checkpoint, so a resumed run continues with the same samples.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3.chat.template import ChatTemplate, Span, TemplateError
from k3.tokenizer import Tokenizer
from k3.vision.chat import ImageError, has_images, image_message_ids
from k3.vision.preprocess import (
    DEFAULT_PROCESSOR,
    MAX_VIDEO_FRAMES,
    ImageProcessor,
    MediaItem,
    image_size,
    pack,
    preprocess_image,
    preprocess_video,
)
from k3.vision.prompt import media_prompt

IGNORE_INDEX = -100


@dataclass(frozen=True)
class MediaRef:
    """One media item of a sample: an image (one source) or a video (its frames), with its prompt size."""

    sources: tuple[str, ...]
    width: int
    height: int
    num_tokens: int

    def load(self, processor: ImageProcessor = DEFAULT_PROCESSOR) -> MediaItem:
        if len(self.sources) == 1:
            return preprocess_image(self.sources[0], processor)
        return preprocess_video(list(self.sources), processor)


@dataclass
class Sample:
    """One row: ids, shifted labels (label t = token t+1, or -100) and its media in order of their pads."""

    name: str
    ids: list[int]
    labels: list[int]
    media: list[MediaRef] = field(default_factory=list)


def resolve_source(source: Any, base: Path, where: str) -> str:
    """A row's image reference → a data URL or an absolute path; ValueError for anything else."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"{where}: an image reference must be a non-empty string (a path or a data URL)")
    if source.startswith("data:"):
        return source
    if source.split(":", 1)[0].lower() in ("http", "https", "ftp"):
        raise ValueError(f"{where}: {source[:80]!r} needs a network fetch, which k3 never does; use a local file or "
                         "a base64 data URL")
    path = Path(source) if Path(source).is_absolute() else base / source
    return str(path)


def media_ref(sources: Sequence[str], processor: ImageProcessor, where: str) -> MediaRef:
    """One item from its resolved sources, sized from the image headers (no pixel decode)."""
    if not 1 <= len(sources) <= MAX_VIDEO_FRAMES:
        raise ValueError(f"{where}: a video item holds 1 to {MAX_VIDEO_FRAMES} frames, got {len(sources)}")
    try:
        sizes = {image_size(s) for s in sources}
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    if len(sizes) != 1:
        raise ValueError(f"{where}: the frames of a video item must share one size, got {sorted(sizes)}")
    (width, height), = sizes
    return MediaRef(tuple(sources), width, height, processor.num_tokens(width, height))


class SampleBuilder:
    """Turns rows into `Sample`s: ids with each item's media prompt, and which tokens are trained on."""

    def __init__(self, tokenizer: Tokenizer, processor: ImageProcessor = DEFAULT_PROCESSOR):
        self.tokenizer, self.processor = tokenizer, processor
        self.template = ChatTemplate(tokenizer)

    def prompt(self, ref: MediaRef) -> list[int]:
        return media_prompt(self.tokenizer, ref.width, ref.height, ref.num_tokens, frames=len(ref.sources))

    def from_row(self, row: Mapping[str, Any], base: Path, name: str) -> Sample:
        if not isinstance(row, Mapping):
            raise ValueError(f"{name}: expected a JSON object")
        if "messages" in row:
            return self.from_messages(row["messages"], base, name)
        text = row.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{name}: a row needs a \"text\" string (with \"image\", \"images\" or \"video\"), or "
                             "\"messages\"")
        refs = []
        if "image" in row:
            refs.append(media_ref([resolve_source(row["image"], base, name)], self.processor, name))
        for source in row.get("images") or []:
            refs.append(media_ref([resolve_source(source, base, name)], self.processor, name))
        if "video" in row:
            frames = row["video"] if isinstance(row["video"], list) else [row["video"]]
            refs.append(media_ref([resolve_source(f, base, name) for f in frames], self.processor, name))
        prompt = [self.tokenizer.bos_id] + [t for ref in refs for t in self.prompt(ref)]
        trained = self.tokenizer.encode(text) + [self.tokenizer.document_end_id]
        return self.sample(name, [(prompt, False), (trained, True)], refs)

    def from_messages(self, messages: Any, base: Path, name: str) -> Sample:
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{name}: \"messages\" must be a non-empty list")
        pieces: list[tuple[list[int], bool]] = [([self.tokenizer.bos_id], False)]
        refs: list[MediaRef] = []
        calls: dict[str, tuple[str, int]] = {}

        def image(url: Any, part: str) -> list[int]:
            ref = media_ref([resolve_source(url, base, f"{name}: {part}")], self.processor, f"{name}: {part}")
            refs.append(ref)
            return self.prompt(ref)

        for i, message in enumerate(messages):
            if has_images(message):
                try:  # the server renders the same message the same way (k3.vision.chat)
                    ids = image_message_ids(self.template, message, image, f"messages[{i}]")
                except ImageError as e:
                    raise ValueError(f"{name}: {e}") from None
                pieces.append((ids, False))
                continue
            try:
                spans: list[Span] = self.template.message_spans(message, thinking=False, calls=calls,
                                                                param=f"messages[{i}]")
            except TemplateError as e:
                raise ValueError(f"{name}: {e} ({e.param})") from e
            pieces += [(span.ids, span.written) for span in spans]
        if not any(trained for _, trained in pieces):
            raise ValueError(f"{name}: the conversation has no assistant message to train on")
        return self.sample(name, pieces, refs)

    def sample(self, name: str, pieces: list[tuple[list[int], bool]], refs: list[MediaRef]) -> Sample:
        ids, trained = [], []
        for piece, is_trained in pieces:
            ids += piece
            trained += [is_trained] * len(piece)
        labels = [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
        return Sample(name, ids, labels, refs)


def read_samples(path: str | os.PathLike, tokenizer: Tokenizer,
                 processor: ImageProcessor = DEFAULT_PROCESSOR) -> list[Sample]:
    """Every row of a `.jsonl` file (or of every `.jsonl` file under a folder, sorted) as a `Sample`; errors name
    the file and line."""
    root = Path(path)
    if not root.exists():
        raise ValueError(f"data path {str(path)!r} does not exist")
    files = sorted(root.rglob("*.jsonl")) if root.is_dir() else [root]
    builder = SampleBuilder(tokenizer, processor)
    samples = []
    for file in files:
        with open(file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{file}:{lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e})") from e
                samples.append(builder.from_row(row, file.parent, where))
    if not samples:
        raise ValueError(f"no rows found in {str(path)!r} (JSONL files)")
    return samples


@dataclass
class MultimodalBatch:
    """`k3.train.data.Batch`'s fields, plus `media`: the model's extra inputs (empty for a text-only batch)."""

    input_ids: torch.Tensor  # [B, T] int64
    labels: torch.Tensor  # [B, T] int64; -100 = no loss
    cu_seqlens: torch.Tensor  # [n_samples + pads + 1] int64, offsets into the flattened B·T tokens
    num_tokens: int  # labelled positions
    media: dict[str, torch.Tensor] = field(default_factory=dict)  # pixel_values [N, 3, p, p], grid_thw [n, 3]

    def to(self, device, non_blocking: bool = False) -> MultimodalBatch:
        move = {k: v.to(device, non_blocking=non_blocking) for k, v in self.media.items()}
        return MultimodalBatch(self.input_ids.to(device, non_blocking=non_blocking),
                               self.labels.to(device, non_blocking=non_blocking),
                               self.cu_seqlens.to(device, non_blocking=non_blocking), self.num_tokens, move)


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The samples of `epoch` in their shuffled order (torch's CPU generator, seeded by (seed, epoch))."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def plan_batches(lengths: Sequence[int], rows: int, seq_len: int, seed: int, epoch: int,
                 cursor: int) -> Iterator[tuple[list[list[int]], tuple[int, int]]]:
    """Endless (batch, (epoch, cursor) after it): a batch is `rows` rows of sample indices, each row the next
    samples of the shuffled order that fit in `seq_len` tokens together."""
    order = epoch_order(len(lengths), seed, epoch)
    while True:
        batch = []
        for _ in range(rows):
            row, used = [], 0
            while True:
                if cursor == len(order):
                    epoch, cursor = epoch + 1, 0
                    order = epoch_order(len(lengths), seed, epoch)
                i = order[cursor]
                if used + lengths[i] > seq_len:
                    break
                row.append(i)
                used += lengths[i]
                cursor += 1
            batch.append(row)
        yield batch, (epoch, cursor)


class _BatchStream(torch.utils.data.IterableDataset):
    """The batches from a position; loader worker w of W builds batches w, w + W, … (in order), the others skip."""

    def __init__(self, owner: MultimodalBatches, epoch: int, cursor: int):
        super().__init__()
        self.owner, self.epoch, self.cursor = owner, epoch, cursor

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        o = self.owner
        plan = plan_batches(o.lengths, o.batch_size, o.seq_len, o.seed, self.epoch, self.cursor)
        for k, (rows, state) in enumerate(plan):
            if k % workers == worker:
                yield o.collate(rows), state


class MultimodalBatches:
    """An endless iterator of `MultimodalBatch`es of `batch_size` rows × `seq_len` tokens from `samples`.

    `loader_workers` processes decode the images (0: in this process). `state_dict()` is the position after
    the last batch returned; `load_state_dict` continues exactly there.
    """

    def __init__(self, samples: Sequence[Sample], batch_size: int, seq_len: int, *, seed: int = 0, pad_id: int,
                 processor: ImageProcessor = DEFAULT_PROCESSOR, loader_workers: int = 0,
                 max_patches: int | None = None):
        if batch_size < 1 or seq_len < 2:
            raise ValueError(f"batch_size must be >= 1 and seq_len >= 2, got {batch_size}, {seq_len}")
        too_long = [s for s in samples if len(s.ids) > seq_len]
        if too_long:
            raise ValueError(f"{len(too_long)} sample(s) do not fit a {seq_len}-token row (e.g. {too_long[0].name}: "
                             f"{len(too_long[0].ids)} tokens); use a longer seq_len or smaller images")
        if not samples:
            raise ValueError("no samples to batch")
        self.samples, self.batch_size, self.seq_len, self.seed = list(samples), batch_size, seq_len, seed
        self.pad_id, self.processor, self.loader_workers, self.max_patches = pad_id, processor, loader_workers, \
            max_patches
        self.lengths = [len(s.ids) for s in self.samples]
        self.epoch, self.cursor = 0, 0
        self._iterator = None

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "num_samples": len(self.samples)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if int(state["seed"]) != self.seed or int(state["num_samples"]) != len(self.samples):
            raise ValueError(f"loader state does not fit this data: {dict(state)} (seed {self.seed}, "
                             f"{len(self.samples)} samples here)")
        if not 0 <= int(state["cursor"]) <= len(self.samples) or int(state["epoch"]) < 0:
            raise ValueError(f"loader state points outside the data: {dict(state)}")
        self.epoch, self.cursor, self._iterator = int(state["epoch"]), int(state["cursor"]), None

    def __iter__(self) -> MultimodalBatches:
        return self

    def __next__(self) -> MultimodalBatch:
        if self._iterator is None:
            stream = _BatchStream(self, self.epoch, self.cursor)
            if self.loader_workers:
                loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=self.loader_workers,
                                                     prefetch_factor=2)
                self._iterator = iter(loader)
            else:
                self._iterator = iter(stream)
        batch, (self.epoch, self.cursor) = next(self._iterator)
        return batch

    def collate(self, rows: list[list[int]]) -> MultimodalBatch:
        """Sample indices per row → one batch: samples back to back, the rest of each row a `[PAD]` segment."""
        B, T = len(rows), self.seq_len
        ids = torch.full((B, T), self.pad_id, dtype=torch.int64)
        labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.int64)
        cu, items = [0], []
        for b, row in enumerate(rows):
            pos = 0
            for i in row:
                s = self.samples[i]
                ids[b, pos:pos + len(s.ids)] = torch.tensor(s.ids)
                labels[b, pos:pos + len(s.ids)] = torch.tensor(s.labels)
                pos += len(s.ids)
                cu.append(b * T + pos)
                items += [ref.load(self.processor) for ref in s.media]
            if pos < T:
                cu.append(b * T + T)
        media = pack(items, self.max_patches).as_inputs() if items else {}
        return MultimodalBatch(ids, labels, torch.tensor(cu, dtype=torch.int64), int((labels != IGNORE_INDEX).sum()),
                               media)


class MultimodalRows:
    """`k3 train`'s data source for multimodal JSONL (the interface of `k3.train.data.TextDocuments`): the rows of
    `read_samples`, one document each (named FILE:LINE), encoded by `SampleBuilder` into ids and a loss mask and
    packed whole by `k3.train.data.PackedBatches`; `media` gives each document's images for `MediaBatches`."""

    format = "multimodal"
    whole_documents = True

    def __init__(self, path: str | os.PathLike, processor: ImageProcessor = DEFAULT_PROCESSOR):
        self.path, self.processor = path, processor

    @staticmethod
    def holds_media(path: str | os.PathLike) -> bool:
        """Does the first row of the JSONL data at `path` (a file, or the first `.jsonl` under a folder) carry an
        image: `image` / `images` / `video` keys, or an `image_url` part in its messages."""
        root = Path(path)
        files = sorted(root.rglob("*.jsonl")) if root.is_dir() else [root] if root.suffix == ".jsonl" else []
        files = [f for f in files if f.is_file()]
        for file in files[:1]:
            # bytes: a bad byte further on is for the reader of the data to report, with its line
            with open(file, "rb") as f:
                for raw in f:
                    line = raw.decode("utf-8", errors="replace")
                    if line.strip():
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError:
                            return False
                        return isinstance(row, Mapping) and (
                            any(k in row for k in ("image", "images", "video"))
                            or any(has_images(m) for m in row.get("messages") or [] if isinstance(m, Mapping)))
        return False

    def documents(self) -> list[tuple[str, str]]:
        """(FILE:LINE, the row with its name and folder as JSON) for every row; ValueError naming the line of a row
        that is not JSON (the rest is checked when the corpus is encoded, naming the line too)."""
        root = Path(self.path)
        if not root.exists():
            raise ValueError(f"data path {str(self.path)!r} does not exist")
        docs = []
        for file in sorted(root.rglob("*.jsonl")) if root.is_dir() else [root]:
            with open(file, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    where = f"{file}:{lineno}"
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{where}: not valid JSON ({e})") from e
                    docs.append((where, json.dumps({"name": where, "base": str(file.parent.resolve()), "row": row})))
        return docs

    def samples(self, tokenizer: Tokenizer, texts: Sequence[str]) -> list[Sample]:
        builder = SampleBuilder(tokenizer, self.processor)
        out = []
        for text in texts:
            doc = json.loads(text)
            out.append(builder.from_row(doc["row"], Path(doc["base"]), doc["name"]))
        return out

    def encode(self, tokenizer: Tokenizer, texts: Sequence[str]) -> list[tuple[list[int], list[int]]]:
        """(ids, loss mask) per document: token t is a target when label t−1 is (labels are shifted)."""
        return [(s.ids, [0] + [int(label != IGNORE_INDEX) for label in s.labels[:-1]])
                for s in self.samples(tokenizer, texts)]

    def media(self, tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[MediaRef]]:
        """Each document's images, in the order of its pads (image headers only, no pixel decode)."""
        return [s.media for s in self.samples(tokenizer, texts)]


class MediaBatches:
    """`k3.train.data.PackedBatches` over a multimodal corpus, each batch with its rows' images attached: a
    `MultimodalBatch` whose `media` holds the pixels of every document of the batch in pad order, decoded by
    `loader_workers` threads. The position is the packed batches' own (`state_dict`), so a resumed run continues
    with the same rows and images."""

    def __init__(self, batches, media: Sequence[Sequence[MediaRef]], processor: ImageProcessor = DEFAULT_PROCESSOR,
                 loader_workers: int = 4, max_patches: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.batches, self.media, self.processor, self.max_patches = batches, media, processor, max_patches
        self.pool = ThreadPoolExecutor(max(1, loader_workers), thread_name_prefix="k3-images")

    @property
    def seq_len(self) -> int:
        return self.batches.seq_len

    def rows_per_epoch(self) -> int:
        return self.batches.rows_per_epoch()

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state)

    def __iter__(self) -> MediaBatches:
        return self

    def __next__(self) -> MultimodalBatch:
        batch = next(self.batches)
        refs = [ref for row in self.batches.last_documents for doc in row for ref in self.media[doc]]
        items = list(self.pool.map(lambda ref: ref.load(self.processor), refs))
        media = pack(items, self.max_patches).as_inputs() if items else {}
        return MultimodalBatch(batch.input_ids, batch.labels, batch.cu_seqlens, batch.num_tokens, media)
