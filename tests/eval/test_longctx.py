"""Long context: the passkey / needle generator (lengths, depths, boundaries), the scorer, the aggregation into a
heat map (with a stand-in model that retrieves up to a length), a run through the server; perplexity through the
server against in-process scoring, bits per byte and position buckets."""

from __future__ import annotations

import math
import re

import pytest

from k3.eval.longctx import (
    NEEDLE_QUESTION,
    PASSKEY_QUESTION,
    ProbeBuilder,
    answer,
    default_lengths,
    plot_heatmap,
    run_retrieval,
)
from k3.eval.perplexity import buckets, plot_by_position, run_perplexity
from k3.infer.score import PromptScorer


@pytest.fixture(scope="module")
def count(tokenizer):
    return lambda text: len(tokenizer.encode(text))


@pytest.mark.parametrize("kind", ["passkey", "needle"])
@pytest.mark.parametrize("length", [300, 1024, 3000])
def test_probe_lengths_and_depths(kind, length, count):
    haystack = ("def f(x):\n    return x + 1\n\n" * 2000) if kind == "needle" else None
    builder = ProbeBuilder(kind, count, haystack)
    positions = []
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        probe = builder.build(length, depth, "48213")
        n = 1 + count(probe.prompt)
        assert length - max(16, length // 50) <= n <= length, (n, length)
        assert probe.prompt.count("48213") == (2 if kind == "passkey" else 1)
        assert probe.prompt.endswith(PASSKEY_QUESTION if kind == "passkey" else NEEDLE_QUESTION)
        needle = builder.needle.format(key="48213")
        body = len(probe.prompt) - len(builder.head) - len(needle) - len(builder.question)
        positions.append((probe.prompt.index(needle) - len(builder.head)) / body)
        if kind == "needle":  # the needle is a whole line
            assert "\nmagic_number = 48213\n" in probe.prompt
        else:  # after a whole sentence
            before = probe.prompt[: probe.prompt.index("The pass key")]
            assert before.endswith((". ", "\n\n"))
    assert positions == sorted(positions) and positions[0] == 0 and positions[-1] == 1


def test_answer_scorer():
    assert answer(" 48213. Remember") == "48213"
    assert answer("48213") == "48213" and answer(" the key") is None and answer(" 4821 3") == "4821"


def test_default_lengths():
    assert default_lengths(8192) == [1024, 2048, 4096]
    assert default_lengths(1 << 20, cap=4096) == [1024, 2048, 4096]
    with pytest.raises(ValueError):
        default_lengths(512)


class RetrievesUpTo:
    """A stand-in server whose model finds the key in prompts up to `limit` tokens, and is wrong beyond."""

    def __init__(self, tokenizer, limit):
        self.tokenizer, self.limit = tokenizer, limit

    def model(self):
        return {"id": "stand-in", "max_model_len": 1 << 20}

    def tokenize(self, text, add_special_tokens=False):
        return self.tokenizer.encode(text)

    def completions(self, prompt, **_):
        n = 1 + len(self.tokenizer.encode(prompt))
        key = re.search(r"(?:pass key is|magic_number =) (\d+)", prompt).group(1)
        reply = f" {key}." if n <= self.limit else " 12345."
        return {"choices": [{"text": reply, "index": 0}], "usage": {"prompt_tokens": n}}


def test_retrieval_aggregation_and_heatmap(tokenizer, tmp_path):
    result = run_retrieval(RetrievesUpTo(tokenizer, 1100), "passkey", [1024, 2048], depths=(0.0, 0.5, 1.0),
                           samples=2, progress=False)
    assert result["accuracy"] == [[1.0, 0.0]] * 3 and result["mean_accuracy"] == 0.5
    assert len(result["cells"]) == 12 and all(c["prompt_tokens"] <= c["length"] for c in result["cells"])
    plot_heatmap(result, tmp_path / "passkey.png")
    assert (tmp_path / "passkey.png").stat().st_size > 1000


def test_needle_through_the_server(endpoint, tmp_path):
    haystack = tmp_path / "hay.txt"
    haystack.write_text("x = 1\ny = x * 2\n" * 3000)
    result = run_retrieval(endpoint.client(), "needle", [1024], depths=(0.0, 1.0), samples=1,
                           haystack_files=[str(haystack)], progress=False)
    assert [len(row) for row in result["accuracy"]] == [1, 1]
    assert all(1000 <= c["prompt_tokens"] <= 1024 for c in result["cells"])


def test_perplexity_through_the_server(endpoint, model, tokenizer, tmp_path):
    text = "the cat sat on a mat. hello world! " * 40
    docs = [("a", text), ("b", "def f(x):\n    return x\n" * 10)]
    window = 64
    result = run_perplexity(endpoint.client(), docs, tokenizer.bos_id, window=window, max_tokens=None,
                            progress=False)
    # the same windows scored in process
    scorer, nll, tokens = PromptScorer(model), 0.0, 0
    for _, t in docs:
        ids = tokenizer.encode(t)
        for a in range(0, len(ids), window - 1):
            s = scorer.score([[tokenizer.bos_id] + ids[a : a + window - 1]])[0]
            nll -= s.total(1)
            tokens += len(s.ids) - 1
    assert result["tokens"] == tokens
    assert result["nats_per_token"] == pytest.approx(nll / tokens, rel=1e-4)
    nbytes = sum(len(t.encode()) for _, t in docs)
    assert result["bytes"] == nbytes
    assert result["bits_per_byte"] == pytest.approx(nll / math.log(2) / nbytes, rel=1e-4)
    assert result["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-3)
    assert sum(r["tokens"] for r in result["by_position"]) == tokens
    assert [(r["from"], r["to"]) for r in result["by_position"]] == buckets(window) == [
        (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64)]
    plot_by_position(result, tmp_path / "ppl.png")
    assert (tmp_path / "ppl.png").stat().st_size > 1000
    capped = run_perplexity(endpoint.client(), docs, tokenizer.bos_id, window=window, max_tokens=50, progress=False)
    assert capped["tokens"] == 50
    with pytest.raises(ValueError):
        run_perplexity(endpoint.client(), [("e", "")], tokenizer.bos_id, progress=False)


def test_scorer_caps_tokens_per_forward(model):
    """The per-forward token cap (which keeps packed perplexity windows off a quadratic attention buffer) splits
    long prompts into cached pieces and packs fewer short ones, and changes no score."""
    import torch

    prompts = [list(range(3, 40)), list(range(5, 30)), list(range(7, 14))]
    ref = PromptScorer(model).score(prompts, top=2)
    capped = PromptScorer(model, max_forward_tokens=16)
    assert capped.tokens_per_forward == 16 and PromptScorer(model).tokens_per_forward > 16
    for a, b in zip(ref, capped.score(prompts, top=2)):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=1e-4, equal_nan=True)
