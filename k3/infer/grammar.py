"""Grammar-constrained decoding: grammars compiled against k3's tokenizer, one matcher per sequence, token bitmasks.

Legend: N rows (sequences sampled this step), V vocabulary, W = ceil(V / 32) mask words.

The library is llguidance (docs/serving.md, "Structured outputs"). K3's tool-call markup is written with
special tokens (`<|open|>`, `<|sep|>`, `<|close|>`), and llguidance's Lark grammars name a token by id
(`<[163587]>`) next to byte-level text rules and `%json {schema}` rules, so one grammar constrains the XTML
structure and the JSON inside it. (xgrammar's grammars are over bytes: special tokens can only be allowed or
forbidden as a whole, not placed in a rule.)

- `GrammarCompiler(**k3.chat.constrain.grammar_vocabulary(tokenizer))` builds llguidance's view of the
  vocabulary once: the text tokens' bytes, and every special token (and every unused placeholder of an
  undertrained BPE) as a special that text rules never produce. (The engine knows no text, so the vocabulary
  comes from above it.) `compile(lark)` returns a `Grammar`, cached by its text (an LRU), so a schema is compiled
  once however many requests use it.
- `Grammar.matcher()` gives a fresh matcher (a copy of the compiled one). The engine keeps one per sequence,
  advances it on every accepted token, and fills the bitmask of the next step before the forward pass
  (`fill_bitmask`, in a worker thread while the model runs; llguidance drops the GIL).
- The sampler applies the mask as a boolean [N, V] (`unpack_bitmask`, on the logits' device) after the
  penalties and before greedy / temperature, so every token drawn is allowed. `naive_unpack_bitmask` is
  the bit-by-bit reference the tests compare it with.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

GRAMMAR_CACHE_SIZE = 256
# threads of llguidance's mask executor: its default sizes itself by the host's CPU count, not this process's
# share, and its first use then costs seconds
MASK_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) // 2))


class GrammarError(ValueError):
    """A grammar (or the JSON schema inside it) that llguidance cannot compile."""


class Grammar:
    """A compiled grammar; `matcher()` is a fresh per-sequence matcher (llguidance `LLMatcher`)."""

    def __init__(self, text: str, compiled: Any):
        self.text = text
        self._compiled = compiled

    def matcher(self) -> Any:
        return self._compiled.deep_copy()


class GrammarCompiler:
    """Compiles Lark grammars (llguidance's dialect) against one tokenizer; compiled grammars are cached by text.

    Thread-safe: the server compiles in its worker pool. `compile_seconds` sums the time spent compiling
    (cache misses only); `hits` / `misses` count lookups.
    """

    def __init__(self, text_tokens: Mapping[bytes, int], special_tokens: Mapping[str, int], eos_id: int,
                 vocab_size: int, pattern: str, cache_size: int = GRAMMAR_CACHE_SIZE):
        """`text_tokens`: bytes → id of every token that writes text; `special_tokens`: name → id of all others;
        `pattern`: the pre-tokenization regex (llguidance tokenizes the grammar's forced text with it)."""
        import llguidance

        self.vocab_size = vocab_size
        self.lltokenizer = llguidance.LLTokenizer.from_tiktoken(
            encoder=dict(text_tokens), special_tokens=dict(special_tokens), pattern=pattern, eos_token=eos_id,
            n_vocab=vocab_size)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.compile_seconds = 0.0

    def compile(self, lark: str) -> Grammar:
        """Lark text → `Grammar`. Raises GrammarError with llguidance's message."""
        import llguidance

        with self._lock:
            grammar = self._cache.get(lark)
            if grammar is not None:
                self._cache.move_to_end(lark)
                self.hits += 1
                return grammar
        t0 = time.perf_counter()
        compiled = llguidance.LLMatcher(self.lltokenizer, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        if compiled.is_error():
            raise GrammarError(compiled.get_error())
        grammar = Grammar(lark, compiled)
        with self._lock:
            self.misses += 1
            self.compile_seconds += time.perf_counter() - t0
            self._cache[lark] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar


_executor = None


def fill_bitmask(matchers: list[Any | None], vocab_size: int) -> torch.Tensor:
    """The allowed next tokens of each row as bits → int32 [N, W] on the CPU (bit t % 32 of word t // 32);
    a row without a matcher allows everything (-1)."""
    global _executor
    import llguidance
    from llguidance.torch import fill_next_token_bitmask_par

    bitmask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
    if rows:
        if _executor is None:
            _executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        fill_next_token_bitmask_par(_executor, rows, bitmask)
    return bitmask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [N, W] → bool [N, V]: token t of row n is allowed when bit t % 32 of word t // 32 is set."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [N, W, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


def naive_unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The reference of `unpack_bitmask`: one Python bit test per token."""
    words = bitmask.tolist()
    return torch.tensor([[bool((row[t // 32] >> (t % 32)) & 1) for t in range(vocab_size)] for row in words])
