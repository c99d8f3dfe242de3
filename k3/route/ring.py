"""Which replica a conversation belongs to: its affinity key, and the consistent-hash ring over the replicas.

The key (`affinity_key`) names what the replicas' prefix caches hold: an explicit session (the `x-session-id`
header, or OpenAI's `prompt_cache_key` body field) when the client gives one, else a hash of the start of the
conversation, which every later turn repeats verbatim (the chat template renders history prefix-stably, see
docs/serving.md "The chat template"). Each key has a preference list on the ring (`Ring.owners`): the primary,
then the pre-assigned secondary (the next distinct replica clockwise, which is exactly where the key would go if
the primary left the ring), then the rest. The ring is `uhashring`'s (md5 points, 160 virtual nodes per replica),
so adding a replica to N moves only about 1/(N+1) of the keys, all of them to the new one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from uhashring import HashRing

SESSION_HEADER = "x-session-id"
PREFIX_CHARS = 256  # a completions prompt is keyed by its first characters (it has no message structure)
PREFIX_TOKEN_IDS = 64  # a token-id prompt by its first ids
VIRTUAL_NODES = 160  # uhashring's default: each replica gets within about 10 % of an even share of keys


class Ring:
    """A consistent-hash ring over replica URLs. `owners(key)`: every replica, in the key's preference order."""

    def __init__(self, replicas: list[str], vnodes: int = VIRTUAL_NODES):
        if not replicas:
            raise ValueError("the ring needs at least one replica")
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"a replica is named twice: {replicas}")
        self._ring = HashRing(nodes=list(replicas), vnodes=vnodes)

    @property
    def replicas(self) -> list[str]:
        return sorted(self._ring.get_nodes())

    def add(self, replica: str) -> None:
        if replica in self._ring.get_nodes():
            raise ValueError(f"{replica} is already on the ring")
        self._ring.add_node(replica)

    def remove(self, replica: str) -> None:
        self._ring.remove_node(replica)

    def owners(self, key: str) -> list[str]:
        """All replicas, distinct, clockwise from the key's point: [primary, secondary, ...]."""
        return list(self._ring.iterate_nodes(key, distinct=True))

    def primary(self, key: str) -> str:
        return self._ring.get_node(key)


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _upto_first_user(items: list[Any]) -> list[Any]:
    """The conversation's opening: every item up to and including the first user message."""
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("role") == "user":
            return items[: i + 1]
    return items


def affinity_key(path: str, body: Any, headers: dict[str, str], session_header: str = SESSION_HEADER,
                 prefix_chars: int = PREFIX_CHARS) -> str | None:
    """The conversation key of a request to `path` (None: the request has no conversation to keep together).

    `headers` lower-cased. Chat: the tools and the messages up to the first user message (system and developer
    prompts included). Completions: the first `prefix_chars` characters (or 64 token ids) of the first prompt.
    Responses: `instructions`, the tools and the input up to its first user message (`previous_response_id` is
    resolved by the router, which remembers which key each response id belongs to).
    """
    session = headers.get(session_header.lower())
    if session:
        return "session:" + session
    if not isinstance(body, dict):
        return None
    if isinstance(body.get("prompt_cache_key"), str) and body["prompt_cache_key"]:
        return "cache:" + body["prompt_cache_key"]
    if path == "/v1/chat/completions" and isinstance(body.get("messages"), list):
        return "chat:" + _digest([body.get("tools"), _upto_first_user(body["messages"])])
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: keyed by its first prompt
        if isinstance(prompt, str):
            return "text:" + _digest(prompt[:prefix_chars])
        if isinstance(prompt, list):
            return "ids:" + _digest(prompt[:PREFIX_TOKEN_IDS])
        return None
    if path == "/v1/responses" and "input" in body:
        given = body["input"]
        opening = _upto_first_user(given) if isinstance(given, list) else given
        return "resp:" + _digest([body.get("instructions"), body.get("tools"), opening])
    return None
