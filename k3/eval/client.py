"""A small client of the OpenAI-compatible server (`k3 serve`, or any server with the same endpoints): what the
k3-native evaluations send. Standard library only (urllib); JSON in, JSON out; an HTTP error raises
`ServerError` with the server's message.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class ServerError(RuntimeError):
    """An HTTP error (`status`) or an unreachable server (`status` 0)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"the server answered {status}: {message}" if status else message)
        self.status = status


class Client:
    """`base_url` is the server's root (`http://127.0.0.1:8000`, with or without a trailing `/v1`)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.timeout = timeout

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raw = e.read().decode("utf-8", errors="replace")
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw[:500]
            raise ServerError(e.code, message) from None
        except urllib.error.URLError as e:
            raise ServerError(0, f"cannot reach {self.base_url}: {e.reason}") from None

    def model(self) -> dict[str, Any]:
        """The served model's card (`id`, `max_model_len`)."""
        cards = self.request("GET", "/v1/models")["data"]
        if not cards:
            raise ServerError(0, f"{self.base_url} serves no model")
        return cards[0]

    def completions(self, **body: Any) -> dict[str, Any]:
        return self.request("POST", "/v1/completions", body)

    def chat(self, **body: Any) -> dict[str, Any]:
        return self.request("POST", "/v1/chat/completions", body)

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.request("POST", "/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})["tokens"]

    def detokenize(self, ids: list[int]) -> str:
        return self.request("POST", "/detokenize", {"tokens": ids})["prompt"]

    def prompt_logprobs(self, prompt: str | list[int]) -> list[float | None]:
        """The prompt's teacher-forced logprobs (echo, nothing generated); entry 0 is None (no context)."""
        out = self.completions(prompt=prompt, max_tokens=0, echo=True, logprobs=0, temperature=0)
        return out["choices"][0]["logprobs"]["token_logprobs"]
