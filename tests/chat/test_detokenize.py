"""Detokenization above the engine: a stream of token ids gives the text of the whole, piece by piece, never
shows a cut character or the start of a stop string, and ends at the first stop string."""

from __future__ import annotations

import random

import pytest

from k3.chat.detokenize import StopMatcher, TextStream, TokenText
from k3.chat.template import ChatTemplate, ReplyStream


class Letters:
    """A toy tokenizer: id -> one letter, no specials."""

    def decode(self, ids):
        return "".join(chr(97 + t % 26) for t in ids)

    def is_special(self, token_id):
        return False


TOKENS = [random.Random(0).randrange(26) for _ in range(40)]


def streamed(stream, ids):
    """Feed one token at a time (the last one with finished=True) -> the visible pieces."""
    return [stream.feed([t], finished=k == len(ids) - 1) for k, t in enumerate(ids)]


def test_text_stream_equals_decode_piece_by_piece(tokenizer):
    text = "é你好 def f(x):\n\treturn x  # ünïcödé"
    ids = tokenizer.encode(text)
    pieces = streamed(TextStream(tokenizer), ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # special tokens are not text (vLLM's default), wherever they come
    marked = [tokenizer.bos_id] + ids[:3] + [tokenizer.special_id("<|open|>")] + ids[3:] + [tokenizer.eos_id]
    assert "".join(streamed(TextStream(tokenizer), marked)) == text


def test_stop_strings_cut_the_text():
    full = Letters().decode(TOKENS)
    stop = full[4:6]
    first = full.find(stop)
    whole = TextStream(Letters(), (stop,))
    assert whole.feed(TOKENS, finished=True) == full[:first] and whole.stopped
    assert TextStream(Letters(), (stop,), include_stop=True).feed(TOKENS, finished=True) == full[: first + 2]
    # streamed text never shows a partial stop string, and adds up to the final text
    stream = TextStream(Letters(), (stop,))
    pieces = streamed(stream, TOKENS)
    assert "".join(pieces) == full[:first] and stream.stopped
    assert stream.feed([1, 2, 3], finished=True) == ""  # nothing after the stop
    # the earliest of several stops wins; one that never comes changes nothing
    later = full[first + 3 : first + 6]
    assert TextStream(Letters(), (later, stop, "zzzzzzzz")).feed(TOKENS, True) == full[:first]
    free = TextStream(Letters(), ("zzzzzzzz",))
    assert "".join(streamed(free, TOKENS)) == full and not free.stopped


def test_stop_matcher_holds_back_a_possible_start():
    m = StopMatcher(["cde"])
    assert m.feed("abc") == "ab"  # "c" may start "cde"
    assert m.feed("d") == ""
    assert m.feed("x") == "cdx"  # it did not
    assert m.feed("yc") == "y"
    assert m.flush() == "c"  # the end: a held tail is shown
    m = StopMatcher(["cde"])
    assert m.feed("abcd") == "ab" and m.feed("ef") == "" and m.hit and m.flush() == ""
    assert StopMatcher([]).feed("anything") == "anything"


def test_reply_stream_cuts_the_content_at_a_stop(tokenizer):
    template = ChatTemplate(tokenizer)
    head = template.open_tag("think")
    message = {"role": "assistant", "reasoning_content": "plan it", "content": "Hello world, again",
               "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}
    ids = template.assistant_body(message, thinking=True)[len(head):] + [template.end_id]
    reply = ReplyStream(tokenizer, thinking=True, stop=("world",))
    pieces = streamed(reply, ids)
    assert "".join(p.reasoning for p in pieces) == "plan it"
    assert "".join(p.content for p in pieces) == "Hello " and reply.stopped
    assert not any(p.tool_calls for p in pieces)  # the calls came after the stop
    free = ReplyStream(tokenizer, thinking=True)
    pieces = streamed(free, ids)
    assert "".join(p.content for p in pieces) == "Hello world, again" and not free.stopped
    assert [c.name for p in pieces for c in p.tool_calls if c.name] == ["f"]


@pytest.mark.parametrize("text", ["a", " the", "é"])
def test_token_text_for_logprobs(tokenizer, text):
    token_text = TokenText(tokenizer)
    for t in tokenizer.encode(text):
        piece, raw = token_text(t)
        assert bytes(raw) == piece.encode() or "\ufffd" in piece
    assert token_text(tokenizer.eos_id) == ("<|end_of_msg|>", list(b"<|end_of_msg|>"))
