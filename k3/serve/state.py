"""What every handler of the server reads: the engine, the text side (tokenizer, chat template, token text),
the served model's name and the options of `create_app`."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from k3.chat.detokenize import TokenText
from k3.chat.template import ChatTemplate
from k3.tokenizer import Tokenizer

PING_SECONDS = 15.0  # `: ping` comments while a stream waits (long prefills), so proxies keep it open
# how long a stream waits for the engine's first event (its acceptance, or a refusal) before sending headers:
# a refusal within it is a 429/503 status, a later one an SSE error event; a first token ends it at once
ADMISSION_WAIT_SECONDS = 2.0


@dataclass
class AppState:
    """The server's state; `create_app` builds one and every handler reads it from `request.app.state.k3`.

    `max_context`: prompt + completion tokens per request; `default_max_tokens`: the completion budget when a
    request sets none (None: the rest of the context); `api_key`: when set, `/v1/*` needs it as a bearer
    token; `medium_effort`: the trained level `reasoning_effort: medium` maps to.
    """

    engine: Any  # a `k3.infer.engine.AsyncEngine`, or anything with its `stream` / `abort` / `metrics`
    tokenizer: Tokenizer
    model_name: str
    max_context: int
    api_key: str | None = None
    default_max_tokens: int | None = None
    medium_effort: str = "high"
    ping_seconds: float = PING_SECONDS
    admission_wait: float = ADMISSION_WAIT_SECONDS
    template: ChatTemplate = field(init=False)
    token_text: TokenText = field(init=False)
    created: int = field(init=False)
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        self.template = ChatTemplate(self.tokenizer, medium_effort=self.medium_effort)
        self.token_text = TokenText(self.tokenizer)
        self.created = int(time.time())
        self.fingerprint = "fp_" + hashlib.blake2b(self.model_name.encode(), digest_size=5).hexdigest()
