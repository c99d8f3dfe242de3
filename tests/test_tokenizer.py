"""Tokenizers: own BPE and the release tiktoken format — round trips, special ids, ordinary text, files."""

import json
import os
import random

import pytest

from k3 import tokenizer as tk
from k3.tokenizer import (
    KIMI_PAT_STR,
    SPECIAL_TOKENS,
    Tokenizer,
    load_tiktoken,
    train_bpe,
    write_tiktoken_files,
)

SAMPLES = [
    "def f(x):\n    return x + 1  # comment\n\n\tclass A: pass\r\n",
    "你好世界，这是一个测试。漢字とひらがなとカタカナ",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 keycap 1️⃣",
    "combining: e\u0301 a\u0308\u0323 \u0915\u094d\u0937 Z\u0351\u0352\u0353",
    "RTL: שלום עולם مرحبا بالعالم",
    "  leading and trailing spaces  \n\n\n   ",
    "It's DON'T we'll THEY'RE 12345678 3.14159 0x1F",
    "\x00\x01\x7f control \u200b zero-width \ufeff bom \U0010ffff",
    "",
]


ALPHABETS = ["abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJ", "0123456789", "你好世界中文字", "αβγδε",
             "()[]{}:.,=+-_*/", "😀👍🎉"]


def _random_words(seed: int, n_words: int) -> str:
    """Words from a fixed 8000-word random lexicon with Zipf frequencies: enough repeats to fill 8192."""
    lexicon_rng = random.Random(1234)
    lexicon = []
    for _ in range(8000):
        alpha = ALPHABETS[lexicon_rng.randrange(len(ALPHABETS))]
        lexicon.append("".join(lexicon_rng.choice(alpha) for _ in range(lexicon_rng.randint(1, 10))))
    rng = random.Random(seed)
    words = rng.choices(lexicon, [1 / (k + 1) for k in range(len(lexicon))], k=n_words)
    seps = rng.choices([" ", " ", " ", "\n", "    ", "\t"], k=n_words)
    return "".join(w + s for w, s in zip(words, seps))


@pytest.fixture(scope="module")
def corpus():
    return [_random_words(seed, 5000) for seed in range(12)] + SAMPLES


@pytest.fixture(scope="module")
def bpe(corpus):
    return train_bpe(corpus, 8192, show_progress=False)


def _byte_soup(seed: int) -> list[str]:
    rng = random.Random(seed)
    raw = bytes(rng.randrange(256) for _ in range(3000))
    code_points = "".join(chr(rng.choice([rng.randrange(0x20, 0x250), rng.randrange(0x250, 0xD800),
                                          rng.randrange(0xE000, 0x110000)])) for _ in range(1000))
    return [raw.decode("latin-1"), raw.decode("utf-8", errors="replace"), raw.decode("utf-8", errors="ignore"),
            code_points]


def test_special_token_table():
    assert len(SPECIAL_TOKENS) == 256 and len(set(SPECIAL_TOKENS)) == 256
    # docs/architecture.md §9.5: id 163584 + offset
    known = {163584: "[BOS]", 163585: "[EOS]", 163586: "<|end_of_msg|>", 163587: "<|open|>", 163588: "<|close|>",
             163589: "<|sep|>", 163590: "[start_header_id]", 163591: "[end_header_id]", 163593: "[EOT]",
             163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>",
             163605: "<|media_pad|>", 163649: "<osagent_mode>", 163838: "[UNK]", 163839: "[PAD]"}
    for token_id, name in known.items():
        assert SPECIAL_TOKENS[token_id - 163584] == name
    assert SPECIAL_TOKENS[8] == "<|reserved_token_8|>"


def test_bpe_special_ids(bpe):
    assert bpe.vocab_size == 8192 and bpe.base_vocab_size == 7936
    # the test corpus is large enough to learn every merge: no placeholders
    assert bpe._backend.get_vocab_size(with_added_tokens=False) == 7936
    assert bpe.bos_id == bpe.special_id("[BOS]") == 7936
    assert bpe.document_end_id == bpe.special_id("[EOS]") == 7937
    assert bpe.eos_id == bpe.special_id("<|end_of_msg|>") == 7938
    assert bpe.special_id("<|media_pad|>") == 7957
    assert bpe.pad_id == bpe.special_id("[PAD]") == 8191
    assert bpe.stop_ids == (7938, 7937)
    assert [bpe.special_id(n) for n in SPECIAL_TOKENS] == list(range(7936, 8192))
    with pytest.raises(ValueError, match="unknown special"):
        bpe.special_id("<|nope|>")


def test_bpe_round_trip_unicode_and_byte_soup(bpe):
    for text in SAMPLES + _byte_soup(0) + _byte_soup(1):
        ids = bpe.encode(text)
        assert all(0 <= i < bpe.base_vocab_size for i in ids)
        assert bpe.decode(ids) == text


def test_specials_in_text_stay_text(bpe):
    for text in ["<|open|>", "user says <|end_of_msg|>[BOS][PAD]<|media_pad|> done"]:
        ids = bpe.encode(text)
        assert not any(bpe.is_special(i) for i in ids)
        assert bpe.decode(ids) == text
    # a special inserted by id decodes to its name
    ids = [bpe.bos_id] + bpe.encode("hi") + [bpe.special_id("<|open|>")]
    assert bpe.decode(ids) == "[BOS]hi<|open|>"


def test_encode_batch_matches_encode(bpe):
    texts = SAMPLES + _byte_soup(2)
    assert bpe.encode_batch(texts) == [bpe.encode(t) for t in texts]


def test_bpe_training_is_deterministic(corpus, bpe):
    again = train_bpe(list(corpus), 8192, show_progress=False)
    assert again.fingerprint() == bpe.fingerprint()
    assert again.mergeable_ranks() == bpe.mergeable_ranks()
    other = train_bpe(corpus[1:], 8192, show_progress=False)
    assert other.fingerprint() != bpe.fingerprint()


def test_small_corpus_keeps_special_offsets():
    # too little text to learn 1792 merges: placeholders fill the base vocabulary
    tok = train_bpe(["tiny corpus, tiny corpus"], 2048, show_progress=False)
    assert tok.vocab_size == 2048 and tok.bos_id == 1792 and tok.pad_id == 2047
    assert tok.decode(tok.encode("tiny ünïcode")) == "tiny ünïcode"
    assert sorted(tok.mergeable_ranks().values()) == list(range(1792))
    with pytest.raises(ValueError, match="at least 512"):
        train_bpe(["x"], 300, show_progress=False)


def test_bpe_save_load_round_trip(bpe, tmp_path):
    bpe.save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    loaded = Tokenizer.load(tmp_path)
    assert loaded.kind == "bpe" and loaded.vocab_size == bpe.vocab_size
    assert loaded.special_tokens == bpe.special_tokens
    assert loaded.fingerprint() == bpe.fingerprint()
    for text in SAMPLES + ["<|open|> stays text"]:
        assert loaded.encode(text) == bpe.encode(text)


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenizer.load(tmp_path)


# ---- release (tiktoken) format ----------------------------------------------------------------------

def test_tiktoken_files_from_own_bpe(bpe, tmp_path):
    write_tiktoken_files(bpe.mergeable_ranks(), tmp_path)
    tok = Tokenizer.load(tmp_path)
    assert tok.kind == "tiktoken"
    assert tok.base_vocab_size == 7936 and tok.vocab_size == 8192
    assert (tok.bos_id, tok.document_end_id, tok.eos_id, tok.pad_id) == (7936, 7937, 7938, 8191)
    assert tok.special_id("<|media_pad|>") == 7957
    for text in SAMPLES + _byte_soup(3):
        ids = tok.encode(text)
        assert all(i < 7936 for i in ids)
        assert tok.decode(ids) == text
    assert not any(tok.is_special(i) for i in tok.encode("<|open|>[BOS]"))
    texts = SAMPLES + _byte_soup(4)
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    # save (release format) → load again
    out = tmp_path / "again"
    tok.save(out)
    again = Tokenizer.load(out)
    assert again.fingerprint() == tok.fingerprint()


def test_tiktoken_release_id_layout(tmp_path):
    """163,584 base ranks (synthetic: bytes, byte pairs, some triples) → specials at 163584 + offset."""
    ranks = {bytes([b]): b for b in range(256)}
    for a in range(256):
        for b in range(256):
            ranks[bytes([a, b])] = len(ranks)
    triple = 0
    while len(ranks) < 163_584:
        ranks[bytes([97 + triple % 26, 97 + (triple // 26) % 26, 32 + triple // 676])] = len(ranks)
        triple += 1
    write_tiktoken_files(ranks, tmp_path, write_config=False)
    tok = load_tiktoken(tmp_path)
    assert tok.vocab_size == 163_840 and tok.base_vocab_size == 163_584
    expected = {"[BOS]": 163584, "[EOS]": 163585, "<|end_of_msg|>": 163586, "<|open|>": 163587,
                "<|close|>": 163588, "<|sep|>": 163589, "[EOT]": 163593, "<|media_pad|>": 163605,
                "<osagent_mode>": 163649, "[UNK]": 163838, "[PAD]": 163839}
    for name, token_id in expected.items():
        assert tok.special_id(name) == token_id
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (163584, 163586, 163839)
    text = "hello wörld 你好 " * 3
    assert tok.decode(tok.encode(text)) == text


def test_tiktoken_partial_added_tokens_decoder(bpe, tmp_path):
    # as the release's tokenization_kimi.py: ids the config does not name are <|reserved_token_{id}|>
    write_tiktoken_files(bpe.mergeable_ranks(), tmp_path, specials={7936: "[BOS]", 7938: "<|end_of_msg|>"})
    tok = load_tiktoken(tmp_path)
    assert tok.special_id("[BOS]") == 7936 and tok.special_id("<|end_of_msg|>") == 7938
    assert tok.special_id("<|reserved_token_7937|>") == 7937
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TikTokenTokenizer"


def test_tiktoken_bad_files(tmp_path):
    (tmp_path / "tiktoken.model").write_text("not-base64!! x\n")
    with pytest.raises(ValueError, match="base64-token rank"):
        load_tiktoken(tmp_path)
    write_tiktoken_files({b"a": 0, b"b": 1}, tmp_path, write_config=False)
    with pytest.raises(ValueError, match="single bytes"):
        load_tiktoken(tmp_path)


def test_kimi_regex_splits_as_published(tmp_path):
    """tiktoken splits exactly like the published pattern (`regex` V1, which knows `&&`, as the reference).

    Ranks hold every reference piece (reachable through its prefixes) and every pair of adjacent
    pieces: a missing split would merge into a pair token, an extra split would break a piece."""
    regex = pytest.importorskip("regex")
    text = ("abc你好 a&b Hello WORLD 你好世界 it's DON'T they'RE 123456 \n\n  x\t\ty ÉTÉ été "
            "naïve ÀB мир Ωμέγα () => {x: 1};\r\n\r\n  end  ")
    pieces = [p.encode() for p in regex.findall("(?V1)" + KIMI_PAT_STR, text)]
    assert b"".join(pieces) == text.encode()
    ranks = {bytes([b]): b for b in range(256)}
    for p in pieces:
        for k in range(2, len(p) + 1):
            ranks.setdefault(p[:k], len(ranks))
    for a, b in zip(pieces, pieces[1:]):
        ranks.setdefault(a + b, len(ranks))
    write_tiktoken_files(ranks, tmp_path)
    tok = load_tiktoken(tmp_path)
    got = [tok._backend.decode_single_token_bytes(i) for i in tok.encode(text)]
    assert got == pieces


def test_tiktoken_long_input_chunked_equals_whole(bpe, tmp_path, monkeypatch):
    write_tiktoken_files(bpe.mergeable_ranks(), tmp_path)
    tok = Tokenizer.load(tmp_path)
    text = "".join(SAMPLES[:-1]) * 20 + _random_words(5, 3000)
    whole = tok._backend.encode_ordinary(text)
    monkeypatch.setattr(tk, "TIKTOKEN_CHUNK_CHARS", 200)
    assert len(tk._safe_chunks(text, 200)) > 10
    assert tok.encode(text) == whole
    assert tok.encode_batch([text, "x"]) == [whole, tok._backend.encode_ordinary("x")]


@pytest.mark.skipif(not os.environ.get("K3_RELEASE_TOKENIZER"),
                    reason="set K3_RELEASE_TOKENIZER to a folder with the released tiktoken.model")
def test_release_goldens():
    tok = Tokenizer.load(os.environ["K3_RELEASE_TOKENIZER"])
    assert tok.vocab_size == 163_840
    assert tok.encode("Hello world") == [19180, 2695]
    assert tok.encode("你好世界") == [33845, 2243]
    assert tok.encode("The capital of France is") == [1008, 10484, 318, 15383, 387]
