"""Generated token ids → text, for every front end: an incremental detokenizer, stop strings, token text.

The engine works in token ids only (`k3/infer/api.py`); the server, `k3 generate`, `k3 chat` and evaluation
turn its outputs into text here. Chat replies go through `k3.chat.template.ReplyStream`, which parses the
reply and applies the same stop strings to its content; plain completions go through `TextStream`.

Two rules a stream keeps:
- A byte-level token can end inside a multi-byte UTF-8 character: that piece is held back until the token
  that completes it (at most `max_hold` tokens, then it is shown as U+FFFD).
- A stream never shows the start of a stop string: text that may still become one is held back; on a match
  the text ends before it (after it with `include_stop`) and nothing more is shown.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from k3.tokenizer import Tokenizer


class IncrementalDecoder:
    """Token ids → text pieces, holding back a cut multi-byte character until the token that completes it."""

    def __init__(self, tokenizer: Tokenizer, max_hold: int = 8):
        self.tokenizer = tokenizer
        self.max_hold = max_hold
        self._pending: list[int] = []

    def feed(self, token_ids: Iterable[int]) -> str:
        self._pending.extend(token_ids)
        if not self._pending:
            return ""
        text = self.tokenizer.decode(self._pending)
        # a byte-level token can end inside a UTF-8 sequence: wait (a little) for the rest of it
        if text.endswith("\ufffd") and len(self._pending) < self.max_hold:
            return ""
        self._pending.clear()
        return text

    def flush(self) -> str:
        text = self.tokenizer.decode(self._pending) if self._pending else ""
        self._pending.clear()
        return text


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back a tail that could start one."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.hit = False
        self._buf = ""

    def feed(self, text: str) -> str:
        if self.hit:
            return ""
        if not self.stops:
            return text
        self._buf += text
        found = [(p, s) for p, s in ((self._buf.find(s), s) for s in self.stops) if p >= 0]
        if found:
            at, stop = min(found, key=lambda f: f[0])
            out = self._buf[:at + (len(stop) if self.include_stop else 0)]
            self._buf, self.hit = "", True
            return out
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self._buf)), keep, -1):
                if self._buf.endswith(s[:k]):
                    keep = k
                    break
        out = self._buf[:len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return out

    def flush(self) -> str:
        out, self._buf = ("" if self.hit else self._buf), ""
        return out


class TextStream:
    """Generated token ids → the visible text of a completion: special tokens left out (vLLM's default
    `skip_special_tokens`), cut characters held back, stop strings matched.

    `feed(ids, finished)` returns the text that became visible; pass `finished=True` with the last ids to
    flush what was held back. `stopped` turns True at a stop string, after which nothing more comes.
    `prefix` is text shown before the first token (a completion's echoed prompt), matched like the rest.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), *, include_stop: bool = False,
                 prefix: str = ""):
        self.tokenizer = tokenizer
        self.decoder = IncrementalDecoder(tokenizer)
        self.stopper = StopMatcher(stop, include_stop)
        self.prefix = prefix

    @property
    def stopped(self) -> bool:
        return self.stopper.hit

    def feed(self, token_ids: Iterable[int], finished: bool = False) -> str:
        text = self.prefix + self.decoder.feed(t for t in token_ids if not self.tokenizer.is_special(t))
        self.prefix = ""
        if finished:
            text += self.decoder.flush()
        text = self.stopper.feed(text)
        if finished and not self.stopper.hit:
            text += self.stopper.flush()
        return text


class TokenText:
    """Token id → (text, UTF-8 bytes) of that one token, as logprobs show it; specials by name. Built on
    first use (it walks the vocabulary)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] | None = None

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if self._bytes is None:
            self._bytes = {i: b for b, i in self.tokenizer.mergeable_ranks().items()}
            self._bytes.update({i: name.encode() for name, i in self.tokenizer.special_tokens.items()})
        raw = self._bytes.get(int(token_id), b"")
        return raw.decode("utf-8", errors="replace"), list(raw)
