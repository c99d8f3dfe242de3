"""Tokenizers: k3's own byte-level BPE and the released K3 tiktoken format, behind one class.

Both kinds share K3's id layout (docs/architecture.md §9.5): a base vocabulary of `vocab_size - 256` byte-level
BPE tokens, then 256 special tokens at fixed offsets above it — offset 0 `[BOS]`, 1 `[EOS]`,
2 `<|end_of_msg|>` (the generation stop token), 3–5 the XTML structural tokens, 21 `<|media_pad|>`,
255 `[PAD]`. With the release vocabulary (base 163,584) these are ids 163,584…163,839; with the `tiny`
preset's 8,192 they are 7,936…8,191, so `ModelConfig`'s `bos/eos/pad_token_id` hold for either kind.

- **Own BPE** (`train_bpe`): HF `tokenizers` — `models.BPE`, `pre_tokenizers.ByteLevel(add_prefix_space=False)`,
  `decoders.ByteLevel` — trained without specials, then the 256 specials appended, saved as `tokenizer.json`.
- **Bytes** (`byte_tokenizer`): the same kind with no merges, so it needs no training: byte b is id b, unused
  placeholders fill the base vocabulary, the specials sit where every preset expects them. For serving
  random weights (`k3 serve --preset`), tests and benchmarks; text costs one token per byte.
- **Release format** (`load_tiktoken`): `tiktoken.model` ("base64-token rank" lines) plus
  `tokenizer_config.json`; tiktoken with the Kimi pre-tokenisation regex, shipped below as `KIMI_PAT_STR`.
  tiktoken's regex engine (fancy-regex over Rust `regex`) accepts the pattern as published, including
  `\\p{Han}` and the `&&` class intersections, so it is used verbatim.

`encode` treats its input as ordinary text: a special token's spelling in user text is encoded as text,
never as the special (docs/data.md). Chat templates insert specials by id (`special_id`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

NUM_SPECIAL_TOKENS = 256
RELEASE_BASE_VOCAB_SIZE = 163_584

_NAMED_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}
# The 256 specials in K3's order; SPECIAL_TOKENS[k] sits at id base_vocab_size + k.
SPECIAL_TOKENS: list[str] = [_NAMED_SPECIALS.get(k, f"<|reserved_token_{k}|>") for k in range(NUM_SPECIAL_TOKENS)]

# Kimi pre-tokenisation regex (docs/architecture.md §9.5), alternatives joined by `|`.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# tiktoken's regex slows down (and can overflow) on very long inputs; longer texts are cut into pieces of
# at most this many characters, only where the Kimi regex must split anyway (see `_safe_chunks`).
TIKTOKEN_CHUNK_CHARS = 100_000
# A newline followed by a printable ASCII character: no pre-token of the Kimi regex contains this pair
# (newlines only end pieces, and a letter prefix may not be a newline), so cutting between them is exact.
_SAFE_CUT = re.compile(r"\n(?=[!-~])")

# texts longer than this go through the batch call, which releases the GIL while it runs: a server's event loop
# keeps answering while a huge prompt is tokenized
LONG_TEXT_CHARS = 65_536


class Tokenizer:
    """Text ↔ ids with K3's special-token layout. Build with `train_bpe`, `load_tiktoken` or `Tokenizer.load`.

    Attributes: `kind` ("bpe" | "tiktoken"), `vocab_size`, `base_vocab_size` (= vocab_size - 256),
    `special_tokens` (name → id, all 256), `bos_id` (`[BOS]`), `document_end_id` (`[EOS]`, ends every
    pretraining document), `eos_id` (`<|end_of_msg|>`, the generation stop token as in K3's config.json),
    `pad_id` (`[PAD]`).
    """

    def __init__(self, backend: Any, kind: Literal["bpe", "tiktoken"], special_tokens: Mapping[str, int],
                 base_vocab_size: int):
        self._backend = backend
        self.kind = kind
        self.base_vocab_size = base_vocab_size
        self.vocab_size = base_vocab_size + NUM_SPECIAL_TOKENS
        self.special_tokens = dict(special_tokens)
        self._special_names = {i: name for name, i in self.special_tokens.items()}
        expected = set(range(base_vocab_size, self.vocab_size))
        assert set(self._special_names) == expected, "the 256 specials must fill ids base..base+255"
        self.bos_id = base_vocab_size + 0
        self.document_end_id = base_vocab_size + 1
        self.eos_id = base_vocab_size + 2
        self.pad_id = base_vocab_size + 255
        if kind == "bpe":
            # the specials live in the HF tokenizer (so tokenizer.json is complete) but are never matched in text
            backend.encode_special_tokens = True

    def special_id(self, name: str) -> int:
        """Id of a special token by name, e.g. `special_id("<|open|>")`."""
        if name not in self.special_tokens:
            raise ValueError(f"unknown special token {name!r}")
        return self.special_tokens[name]

    @property
    def stop_ids(self) -> tuple[int, int]:
        """Ids that end generation: `<|end_of_msg|>` (chat) and `[EOS]` (end of a pretraining document)."""
        return (self.eos_id, self.document_end_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_names

    def encode(self, text: str) -> list[int]:
        """Ordinary text → ids (no BOS/EOS added; special-token spellings stay text)."""
        if self.kind == "bpe":
            if len(text) > LONG_TEXT_CHARS:
                return self.encode_batch([text])[0]
            return self._backend.encode(text, add_special_tokens=False).ids
        chunks = _safe_chunks(text, TIKTOKEN_CHUNK_CHARS)
        if len(chunks) == 1:
            return self._backend.encode_ordinary(text)
        return [i for ids in self._backend.encode_ordinary_batch(chunks) for i in ids]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` for many texts at once, in parallel inside the Rust tokenizer."""
        texts = list(texts)
        if self.kind == "bpe":
            fast = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
            return [e.ids for e in fast(texts, add_special_tokens=False)]
        pieces, owner = [], []
        for k, text in enumerate(texts):
            for chunk in _safe_chunks(text, TIKTOKEN_CHUNK_CHARS):
                pieces.append(chunk)
                owner.append(k)
        out: list[list[int]] = [[] for _ in texts]
        for k, ids in zip(owner, self._backend.encode_ordinary_batch(pieces)):
            out[k].extend(ids)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Ids → text; specials appear as their names; invalid UTF-8 (a cut multi-byte char) becomes U+FFFD."""
        ids = [int(i) for i in ids]
        if self.kind == "bpe":
            return self._backend.decode(ids, skip_special_tokens=False)
        return self._backend.decode(ids)

    def save(self, directory: str | os.PathLike) -> None:
        """Write `tokenizer.json` (own BPE) or `tiktoken.model` + `tokenizer_config.json` (release format)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.kind == "bpe":
            (directory / "tokenizer.json").write_text(self._backend.to_str(), encoding="utf-8")
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[BOS]", "eos_token": "[EOS]",
                      "pad_token": "[PAD]", "unk_token": "[UNK]"}
            (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            return
        (directory / "tokenizer.json").unlink(missing_ok=True)
        names = {i: name for name, i in self.special_tokens.items()}
        write_tiktoken_files(self.mergeable_ranks(), directory, specials=names)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Tokenizer:
        """Load from a folder holding `tokenizer.json` (own BPE; preferred) or `tiktoken.model` (release)."""
        directory = Path(directory)
        if (directory / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))
            vocab_size = backend.get_vocab_size(with_added_tokens=True)
            base = vocab_size - NUM_SPECIAL_TOKENS
            specials = {}
            for token_id, token in backend.get_added_tokens_decoder().items():
                if token_id >= base:
                    specials[token.content] = token_id
            if base < 256 or len(specials) != NUM_SPECIAL_TOKENS:
                raise ValueError(f"{directory / 'tokenizer.json'} does not end in the 256 K3 special tokens")
            return cls(backend, "bpe", specials, base)
        if (directory / "tiktoken.model").is_file():
            return load_tiktoken(directory)
        raise ValueError(f"no tokenizer in {directory}: expected tokenizer.json or tiktoken.model")

    def mergeable_ranks(self) -> dict[bytes, int]:
        """The base vocabulary as raw bytes → id (tiktoken's `mergeable_ranks`)."""
        if self.kind == "tiktoken":
            return dict(self._backend._mergeable_ranks)
        decoder = _byte_decoder()
        ranks = {}
        for piece, token_id in self._backend.get_vocab(with_added_tokens=False).items():
            ranks[bytes(decoder[c] for c in piece)] = token_id
        # placeholders that filled an undertrained base vocabulary (see train_bpe): their text as bytes
        for token_id, token in self._backend.get_added_tokens_decoder().items():
            if token_id < self.base_vocab_size:
                ranks[token.content.encode()] = token_id
        return ranks

    def fingerprint(self) -> str:
        """A hash of everything that decides the ids, to tell whether a tokenized corpus matches."""
        h = hashlib.sha256(self.kind.encode())
        if self.kind == "bpe":
            h.update(self._backend.to_str().encode())
        else:
            h.update(self._backend._pat_str.encode())
            for token, rank in sorted(self._backend._mergeable_ranks.items(), key=lambda kv: kv[1]):
                h.update(rank.to_bytes(8, "little") + token)
        h.update(json.dumps(sorted(self.special_tokens.items())).encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"


def _safe_chunks(text: str, limit: int) -> list[str]:
    """Cut `text` into pieces of ≤ `limit` chars at `_SAFE_CUT` points (a piece may exceed it if no cut exists)."""
    if len(text) <= limit:
        return [text]
    chunks, start, last_cut = [], 0, 0
    for m in _SAFE_CUT.finditer(text):
        cut = m.end()
        if cut - start > limit and last_cut > start:
            chunks.append(text[start:last_cut])
            start = last_cut
        last_cut = cut
    if len(text) - start > limit and last_cut > start:
        chunks.append(text[start:last_cut])
        start = last_cut
    chunks.append(text[start:])
    return chunks


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable stand-in character → byte."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1))
    keep |= set(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append((chr(b), b))
        else:
            chars.append((chr(256 + extra), b))
            extra += 1
    return dict(chars)


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = True, *,
              max_chars: int = 64_000_000, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size - 256` base tokens, then append K3's 256 specials.

    Deterministic for the same input. If the texts hold more than `max_chars` characters, a fixed
    subset of whole texts (chosen by a hash of their content, so independent of order) of about that
    size is used. If the texts are too small to learn enough merges, unused placeholder tokens
    `<|bpe_unused_{id}|>` fill the base vocabulary so that the specials still land at base..base+255.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    base = vocab_size - NUM_SPECIAL_TOKENS
    if base < 256:
        raise ValueError(f"vocab_size must be at least 512 (256 bytes + 256 specials), got {vocab_size}")
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError("train_bpe needs at least one non-empty text")
    total = sum(len(t) for t in texts)
    if total > max_chars:
        keep = max_chars / total
        texts = [t for t in texts if _unit_hash(t) < keep]

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=base, min_frequency=min_frequency, show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    backend.train_from_iterator(texts, trainer, length=len(texts))
    return _with_specials(backend, base)


def byte_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level tokenizer that needs no training: id b is byte b (0..255), placeholders
    `<|bpe_unused_{id}|>` up to `vocab_size - 256`, then K3's 256 specials (the layout of `train_bpe`)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    base = vocab_size - NUM_SPECIAL_TOKENS
    if base < 256:
        raise ValueError(f"vocab_size must be at least 512 (256 bytes + 256 specials), got {vocab_size}")
    backend = HFTokenizer(models.BPE(vocab=dict(_byte_decoder()), merges=[]))  # byte-level stand-in char → byte
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return _with_specials(backend, base)


def _with_specials(backend: Any, base: int) -> Tokenizer:
    """An HF BPE of at most `base` tokens → a `Tokenizer`: unused placeholders fill the base vocabulary, so
    that K3's 256 specials land at base..base+255."""
    from tokenizers import AddedToken

    learned = backend.get_vocab_size(with_added_tokens=False)
    assert learned <= base
    fill = [AddedToken(f"<|bpe_unused_{i}|>", special=True, normalized=False) for i in range(learned, base)]
    specials = [AddedToken(name, special=True, normalized=False) for name in SPECIAL_TOKENS]
    backend.add_special_tokens(fill + specials)
    ids = {name: backend.token_to_id(name) for name in SPECIAL_TOKENS}
    assert [ids[n] for n in SPECIAL_TOKENS] == list(range(base, base + NUM_SPECIAL_TOKENS)), \
        "specials must land at base+offset"
    return Tokenizer(backend, "bpe", ids, base)


def _unit_hash(text: str) -> float:
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def load_tiktoken(directory: str | os.PathLike) -> Tokenizer:
    """Load K3's release tokenizer: `tiktoken.model` + `tokenizer_config.json` (optional).

    The base vocabulary is every line of `tiktoken.model` (ranks 0..n-1). The 256 specials take ids
    n..n+255: named from `added_tokens_decoder` when the config has one (ids it leaves out are named
    `<|reserved_token_{id}|>`, as the release's `tokenization_kimi.py` does), else from `SPECIAL_TOKENS`.
    """
    import tiktoken

    directory = Path(directory)
    model_path = directory / "tiktoken.model"
    if not model_path.is_file():
        raise ValueError(f"no tiktoken.model in {directory}")
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(model_path.read_text(encoding="ascii").splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{model_path}:{lineno}: expected 'base64-token rank', got {line[:80]!r}") from e
    base = len(ranks)
    if sorted(ranks.values()) != list(range(base)):
        raise ValueError(f"{model_path}: ranks must be 0..{base - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{model_path}: single bytes {missing[:8]} are missing; a byte-level BPE needs all 256")

    names = {base + k: name for k, name in enumerate(SPECIAL_TOKENS)}
    config_path = directory / "tokenizer_config.json"
    if config_path.is_file():
        decoder = json.loads(config_path.read_text(encoding="utf-8")).get("added_tokens_decoder")
        if decoder:
            given = {int(i): (v["content"] if isinstance(v, dict) else str(v)) for i, v in decoder.items()}
            names = {i: given.get(i, f"<|reserved_token_{i}|>") for i in range(base, base + NUM_SPECIAL_TOKENS)}
    specials = {name: i for i, name in names.items()}
    if len(specials) != NUM_SPECIAL_TOKENS:
        raise ValueError(f"{config_path}: two special tokens share a name")
    encoding = tiktoken.Encoding(name=directory.name or "k3", pat_str=KIMI_PAT_STR,
                                 mergeable_ranks=ranks, special_tokens=specials)
    return Tokenizer(encoding, "tiktoken", specials, base)


def write_tiktoken_files(tokenizer_ranks: Mapping[bytes, int], directory: str | os.PathLike, *,
                         specials: Mapping[int, str] | None = None, write_config: bool = True) -> None:
    """Write a tokenizer in the release format: `tiktoken.model` and `tokenizer_config.json`.

    `tokenizer_ranks`: bytes → rank, ranks 0..n-1 including all 256 single bytes (e.g. an own BPE's
    `mergeable_ranks()`). `specials`: id → name for `added_tokens_decoder`; default all of
    `SPECIAL_TOKENS` at n + offset. Used to save tiktoken-backed tokenizers and by tests (no hub).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    base = len(tokenizer_ranks)
    lines = [f"{base64.b64encode(token).decode()} {rank}"
             for token, rank in sorted(tokenizer_ranks.items(), key=lambda kv: kv[1])]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n", encoding="ascii")
    if not write_config:
        return
    if specials is None:
        specials = {base + k: name for k, name in enumerate(SPECIAL_TOKENS)}
    added = {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, name in sorted(specials.items())}
    config = {"tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
              "pad_token": "[PAD]", "unk_token": "[UNK]", "added_tokens_decoder": added}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")
