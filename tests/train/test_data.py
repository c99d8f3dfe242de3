"""Data pipeline: documents, split, tokenized corpus, packing (labels, coverage, resume, ranks), errors."""

import json
import random

import numpy as np
import pytest
import torch

from k3.model.sequence import SequenceLayout
from k3.train.data import (
    IGNORE_INDEX,
    PackedBatches,
    TokenizedCorpus,
    document_permutation,
    documents_fingerprint,
    prepare_corpus,
    read_documents,
    split_documents,
    stdlib_documents,
)
from k3.tokenizer import train_bpe

B, T = 3, 32


class ByteTokenizer:
    """Token = UTF-8 byte; specials above 255. Makes every token of a document predictable."""

    vocab_size, bos_id, document_end_id, pad_id = 512, 256, 257, 511

    def encode_batch(self, texts):
        return [list(t.encode()) for t in texts]

    def fingerprint(self):
        return "bytes"


def make_docs(n: int, seed: int = 0, max_len: int = 150) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    docs = [(f"doc{i:03d}.txt", "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, max_len))))
            for i in range(n)]
    # documents longer than several rows, so fragments continue across rows
    docs += [(f"long{i}.txt", "x" * (3 * T + 5 + i)) for i in range(3)]
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(make_docs(40), ByteTokenizer(), tmp_path_factory.mktemp("c") / "train", show_progress=False)


def segments(batch):
    """(input ids, labels) per cu_seqlens segment of the flattened batch."""
    ids, labels = batch.input_ids.flatten(), batch.labels.flatten()
    cu = batch.cu_seqlens.tolist()
    return [(ids[a:b], labels[a:b]) for a, b in zip(cu, cu[1:])]


def check_batch(batch, pad_id=ByteTokenizer.pad_id):
    assert batch.input_ids.shape == batch.labels.shape == (B, T)
    assert batch.input_ids.dtype == batch.labels.dtype == batch.cu_seqlens.dtype == torch.int64
    SequenceLayout.build(B, T, batch.cu_seqlens, "cpu")  # the model's own validation
    cu = batch.cu_seqlens
    for b in range(B):
        # -100 count per row = fragments per row (no padding while training)
        in_row = int(((cu > b * T) & (cu <= (b + 1) * T)).sum())
        if not bool((batch.input_ids[b] == pad_id).any()):
            assert int((batch.labels[b] == IGNORE_INDEX).sum()) == in_row
    for ids, labels in segments(batch):
        if bool((ids == pad_id).all()):
            assert bool((labels == IGNORE_INDEX).all())
            continue
        # label t = token t+1 of the same fragment; the last one is ignored: nothing crosses a boundary
        assert torch.equal(labels[:-1], ids[1:])
        assert labels[-1] == IGNORE_INDEX
    assert batch.num_tokens == int((batch.labels != IGNORE_INDEX).sum())


def test_prepare_and_open(corpus, tmp_path):
    docs = make_docs(40)
    assert corpus.num_documents == len(docs)
    assert corpus.num_tokens == sum(len(t.encode()) + 2 for _, t in docs)
    for i in (0, 17, len(docs) - 1):
        assert corpus.document(i).tolist() == [256, *docs[i][1].encode(), 257]
    again = TokenizedCorpus.open(corpus.directory)
    assert np.array_equal(np.asarray(again.tokens), np.asarray(corpus.tokens))
    assert again.meta["documents"] == documents_fingerprint(docs)
    assert again.meta["tokenizer"] == "bytes" and again.meta["pad_id"] == 511
    # prepare replaces an existing corpus atomically, leaving no temporary folders behind
    target = tmp_path / "c"
    prepare_corpus(docs[:5], ByteTokenizer(), target, show_progress=False)
    prepare_corpus(docs[:7], ByteTokenizer(), target, show_progress=False)
    assert TokenizedCorpus.open(target).num_documents == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_prepare_with_real_tokenizer(tmp_path):
    docs = [("a.py", "def f():\n    return 1\n"), ("b.py", "print('héllo')\n")]
    tok = train_bpe([t for _, t in docs], 512, show_progress=False)
    corpus = prepare_corpus(docs, tok, tmp_path / "c", show_progress=False)
    first = corpus.document(0).tolist()
    assert first[0] == tok.bos_id and first[-1] == tok.document_end_id
    assert tok.decode(first[1:-1]) == docs[0][1]
    assert corpus.unigram_entropy() > 0


def test_corrupted_or_missing_corpus(corpus, tmp_path):
    with pytest.raises(ValueError, match="not a prepared corpus"):
        TokenizedCorpus.open(tmp_path / "nothing")
    broken = tmp_path / "broken"
    prepare_corpus(make_docs(5), ByteTokenizer(), broken, show_progress=False)
    data = (broken / "tokens.bin").read_bytes()
    (broken / "tokens.bin").write_bytes(data[:-4])
    with pytest.raises(ValueError, match="corrupted"):
        TokenizedCorpus.open(broken)
    with pytest.raises(ValueError, match="no non-empty documents"):
        prepare_corpus([("a", "")], ByteTokenizer(), tmp_path / "empty", show_progress=False)


def test_labels_and_boundaries(corpus):
    it = PackedBatches(corpus, B, T, seed=0)
    saw_continued_fragment = False
    for _ in range(40):
        batch = next(it)
        check_batch(batch)
        # a row that starts inside a document starts without BOS
        saw_continued_fragment |= bool((batch.input_ids[:, 0] != ByteTokenizer.bos_id).any())
    assert saw_continued_fragment


def test_each_epoch_covers_the_documents_once(corpus):
    it = PackedBatches(corpus, B, T, seed=3)
    epochs = 3
    expected = np.concatenate([corpus.document(int(d)) for e in range(epochs) for d in it.order(e)])
    stream = []
    while sum(len(s) for s in stream) < len(expected) - B * T:
        stream.append(next(it).input_ids.flatten().numpy())
    stream = np.concatenate(stream)
    assert np.array_equal(stream, expected[:len(stream)])
    for e in range(epochs):
        assert sorted(it.order(e).tolist()) == list(range(corpus.num_documents))
    assert it.epoch == epochs - 1
    assert it.order(0).tolist() != it.order(1).tolist()


def test_permutation_is_pinned():
    # the shuffle must never change under a resumed run (no numpy/torch RNG involved)
    assert document_permutation(10, 0, 0).tolist() == [1, 4, 5, 7, 6, 9, 0, 3, 2, 8]
    assert document_permutation(10, 0, 1).tolist() == [8, 6, 9, 0, 7, 3, 5, 2, 4, 1]
    assert document_permutation(10, 1, 0).tolist() == [8, 4, 0, 7, 3, 1, 2, 9, 5, 6]


def test_different_seeds_give_different_orders(corpus):
    a, b = PackedBatches(corpus, B, T, seed=0), PackedBatches(corpus, B, T, seed=1)
    assert a.order(0).tolist() != b.order(0).tolist()
    assert not torch.equal(next(a).input_ids, next(b).input_ids)
    c = PackedBatches(corpus, B, T, seed=0)
    assert torch.equal(next(c).input_ids, next(PackedBatches(corpus, B, T, seed=0)).input_ids)


@pytest.mark.parametrize("streams", [1, 4])
def test_resume_gives_identical_batches(corpus, streams):
    tokens_per_batch = B * T
    epoch_batches = corpus.num_tokens // tokens_per_batch
    # includes a resume point whose next batches cross into the next epoch
    for n in (0, 7, epoch_batches - 2):
        it = PackedBatches(corpus, B, T, seed=5, streams=streams)
        for _ in range(n):
            next(it)
        state = json.loads(json.dumps(it.state_dict()))  # plain JSON (and weights-only torch.load) data
        reference = [next(it) for _ in range(5)]
        fresh = PackedBatches(corpus, B, T, seed=5)  # the state carries the stream layout
        fresh.load_state_dict(state)
        for want, got in zip(reference, (next(fresh) for _ in range(5))):
            assert torch.equal(want.input_ids, got.input_ids)
            assert torch.equal(want.labels, got.labels)
            assert torch.equal(want.cu_seqlens, got.cu_seqlens)
            assert want.num_tokens == got.num_tokens
        if n == epoch_batches - 2 and streams == 1:
            assert fresh.epoch == 1 and state["positions"][0][0] == 0


def test_resume_rejects_other_data(corpus):
    state = PackedBatches(corpus, B, T, seed=5).state_dict()
    with pytest.raises(ValueError, match="seed"):
        PackedBatches(corpus, B, T, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="outside"):
        PackedBatches(corpus, B, T, seed=5).load_state_dict({**state, "positions": [[0, 10**6, 0]]})


def test_ranks_split_global_rows(corpus):
    """Rank r of W keeps global rows ≡ r (mod W); the state means the same at any world size."""
    single = PackedBatches(corpus, 2, T, seed=1)
    ranks = [PackedBatches(corpus, 1, T, seed=1, rank=r, world_size=2) for r in range(2)]
    for _ in range(6):
        both = next(single)
        parts = [next(r) for r in ranks]
        assert torch.equal(both.input_ids, torch.cat([p.input_ids for p in parts]))
        assert torch.equal(both.labels, torch.cat([p.labels for p in parts]))
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()
    # resume the 2-rank position on one rank: the global order continues
    one = PackedBatches(corpus, 2, T, seed=1)
    one.load_state_dict(ranks[0].state_dict())
    assert torch.equal(next(one).input_ids, next(single).input_ids)


def test_eval_pass_is_complete_and_deterministic(corpus):
    batches = list(PackedBatches.eval(corpus, B, T))
    assert len(batches) == len(PackedBatches.eval(corpus, B, T))
    for batch in batches:
        check_batch(batch)
    stream = torch.cat([b.input_ids.flatten() for b in batches]).numpy()
    n = corpus.num_tokens
    assert np.array_equal(stream[:n], np.asarray(corpus.tokens))
    assert (stream[n:] == ByteTokenizer.pad_id).all() and len(stream) - n < B * T
    again = list(PackedBatches.eval(corpus, B, T))
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(batches, again))
    # a corpus smaller than one batch is fine for evaluation (padded), not for training
    small = prepare_corpus(make_docs(2, max_len=5)[:2], ByteTokenizer(), corpus.directory.parent / "small",
                           show_progress=False)
    assert len(list(PackedBatches.eval(small, B, T))) == 1
    with pytest.raises(ValueError, match="fewer than one batch"):
        PackedBatches(small, B, T)


def test_heldout_split_is_disjoint_and_stable():
    docs = [(f"pkg/mod{i}.py", f"x = {i}") for i in range(2000)]
    train, held = split_documents(docs, 0.05, seed=0)
    names_t, names_h = {n for n, _ in train}, {n for n, _ in held}
    assert not names_t & names_h and len(names_t | names_h) == len(docs)
    assert 50 < len(held) < 150
    # adding files moves none of the old ones
    more = docs + [(f"new/file{i}.py", "y") for i in range(300)]
    train2, held2 = split_documents(more, 0.05, seed=0)
    assert {n for n, _ in held2 if not n.startswith("new/")} == names_h
    assert split_documents(docs, 0.05, seed=0) == (train, held)
    assert {n for n, _ in split_documents(docs, 0.05, seed=1)[1]} != names_h
    # tiny corpora still get one held-out document
    assert len(split_documents(docs[:3], 0.02)[1]) == 1
    with pytest.raises(ValueError):
        split_documents(docs, 1.0)


def test_read_documents(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.md").write_text("# markdown")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "c.py").write_text("print(1)\n")
    (sub / "d.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 2}) + "\n")
    (sub / "e.bin").write_bytes(b"\x00\x01\x02binary")
    (sub / "f.dat").write_bytes(b"\xff\xfe not utf-8")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "g.txt").write_text("skipped")
    docs = read_documents(tmp_path)
    assert docs == [("a.txt", "plain text"), ("b.md", "# markdown"), ("sub/c.py", "print(1)\n"),
                    ("sub/d.jsonl:1", "one"), ("sub/d.jsonl:3", "two")]
    assert read_documents(sub / "d.jsonl") == [("d.jsonl:1", "one"), ("d.jsonl:3", "two")]
    assert read_documents(tmp_path / "a.txt") == [("a.txt", "plain text")]


def test_read_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["first", "", "third"], "n": [1, 2, 3]}), tmp_path / "x.parquet")
    assert read_documents(tmp_path / "x.parquet") == [("x.parquet:0", "first"), ("x.parquet:2", "third")]
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "y.parquet")
    with pytest.raises(ValueError, match="no 'text' column"):
        read_documents(tmp_path / "y.parquet")


def test_read_documents_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_documents(tmp_path / "missing")
    with pytest.raises(ValueError, match="no documents"):
        read_documents(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="no documents"):
        read_documents(tmp_path / "empty.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_documents(tmp_path / "bad.jsonl")
    (tmp_path / "bin.dat").write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_documents(tmp_path / "bin.dat")


def test_stdlib_documents():
    docs = stdlib_documents()
    names = [n for n, _ in docs]
    assert len(docs) > 100 and names == sorted(names) and len(set(names)) == len(names)
    assert all(n.endswith(".py") and "site-packages" not in n and "/test/" not in f"/{n}" for n in names)
    assert "os.py" in names and all(text for _, text in docs)


def test_streams_mix_documents_within_a_batch(corpus):
    """Dealt into S streams, the B rows of a batch come from B different streams; each stream reads its
    own slice of the epoch's permutation, so one epoch still visits every document once."""
    S = 4
    it = PackedBatches(corpus, S, T, seed=2, streams=S)
    order = it.order(0)
    expected = [np.concatenate([corpus.document(int(d)) for d in order[s::S]]) for s in range(S)]
    got = [[] for _ in range(S)]
    for _ in range(6):
        batch = next(it)
        for s in range(S):  # row s of every batch is the next row of stream s
            got[s].append(batch.input_ids[s].numpy())
    for s in range(S):
        row_stream = np.concatenate(got[s])
        assert np.array_equal(row_stream, expected[s][: len(row_stream)])
    assert sorted(np.concatenate([order[s::S] for s in range(S)]).tolist()) == list(range(corpus.num_documents))


def test_state_from_before_streams_continues_as_one_stream(corpus):
    it = PackedBatches(corpus, B, T, seed=5)
    for _ in range(3):
        next(it)
    (epoch, document, offset), = it.state_dict()["positions"]
    old = {k: v for k, v in it.state_dict().items() if k not in ("streams", "positions")}
    old.update(epoch=epoch, document=document, offset=offset)
    fresh = PackedBatches(corpus, B, T, seed=5, streams=8)
    fresh.load_state_dict(old)
    assert fresh.streams == 1 and torch.equal(next(fresh).input_ids, next(it).input_ids)
