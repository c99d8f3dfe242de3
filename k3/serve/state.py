"""What every handler of the server reads: the engine, the text side (tokenizer, chat template, token text),
the served model's name and the options of `create_app`."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from k3.chat.detokenize import TokenText
from k3.chat.template import ChatTemplate
from k3.tokenizer import Tokenizer

PING_SECONDS = 15.0  # `: ping` comments while a stream waits (long prefills), so proxies keep it open
# how long a stream waits for the engine's first event (its acceptance, or a refusal) before sending headers:
# a refusal within it is a 429/503 status, a later one an SSE error event; a first token ends it at once
ADMISSION_WAIT_SECONDS = 2.0
STORED_RESPONSES = 1024  # responses kept for `previous_response_id` (store: true), least recently used dropped
MAX_REQUEST_BYTES = 8 * 2**20  # a request body over this is a 413, before it is parsed or tokenized
# parsing, rendering, tokenizing and grammar compiling run in this many worker threads, off the event loop
PREPARE_WORKERS = 4


@dataclass
class AppState:
    """The server's state; `create_app` builds one and every handler reads it from `request.app.state.k3`.

    `max_context`: prompt + completion tokens per request; `default_max_tokens`: the completion budget when a
    request sets none (None: the rest of the context); `api_key`: when set, `/v1/*` needs it as a bearer
    token; `medium_effort`: the trained level `reasoning_effort: medium` maps to; `scorer`: the prompt scorer
    behind echo with logprobs (`k3.infer.score.PromptScorer`; None: not available); `images`: the policy for
    `image_url` parts (`k3.vision.chat.ImagePolicy`; None: a text-only model, images refused).
    """

    engine: Any  # a `k3.infer.engine.AsyncEngine`, or anything with its `stream` / `abort` / `metrics`
    tokenizer: Tokenizer
    model_name: str
    max_context: int
    api_key: str | None = None
    scorer: Any = None
    images: Any = None
    default_max_tokens: int | None = None
    medium_effort: str = "high"
    ping_seconds: float = PING_SECONDS
    admission_wait: float = ADMISSION_WAIT_SECONDS
    max_request_bytes: int = MAX_REQUEST_BYTES
    template: ChatTemplate = field(init=False)
    token_text: TokenText = field(init=False)
    created: int = field(init=False)
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        self.template = ChatTemplate(self.tokenizer, medium_effort=self.medium_effort)
        self.token_text = TokenText(self.tokenizer)
        self.created = int(time.time())
        self.fingerprint = "fp_" + hashlib.blake2b(self.model_name.encode(), digest_size=5).hexdigest()
        self.max_token_bytes = max(len(piece) for piece in self.tokenizer.mergeable_ranks())
        self.workers = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="k3-prepare")
        self._grammars = None
        self._grammars_lock = threading.Lock()
        self.stored: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def store_response(self, response_id: str, entry: dict[str, Any]) -> None:
        """Keep a stored response (Responses API `store: true`) in the bounded LRU."""
        self.stored[response_id] = entry
        while len(self.stored) > STORED_RESPONSES:
            self.stored.popitem(last=False)

    @property
    def grammars(self) -> Any:
        """The tokenizer's `k3.infer.grammar.GrammarCompiler`, built at first use (it walks the vocabulary)."""
        with self._grammars_lock:
            if self._grammars is None:
                from k3.chat.constrain import grammar_vocabulary
                from k3.infer.grammar import GrammarCompiler

                self._grammars = GrammarCompiler(**grammar_vocabulary(self.tokenizer))
            return self._grammars

    async def offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` in the worker pool, so the event loop keeps answering (health checks, streams)."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)
