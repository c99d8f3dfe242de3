"""`RouterConfig`: everything `k3 route` takes, importable without the web stack (the CLI builds its flags from it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from k3.route.ring import PREFIX_CHARS, SESSION_HEADER, VIRTUAL_NODES
from k3.serve.state import MAX_REQUEST_BYTES

Balance = Literal["affinity", "least-loaded"]


@dataclass
class RouterConfig:
    """Everything `k3 route` takes; every field is a flag of the same name."""

    replicas: list[str]
    balance: Balance = "affinity"
    session_header: str = SESSION_HEADER
    prefix_chars: int = PREFIX_CHARS
    vnodes: int = VIRTUAL_NODES
    health_interval: float = 1.0
    health_timeout: float = 2.0
    fail_after: int = 3
    connect_timeout: float = 2.0
    read_timeout: float = 600.0
    long_threshold: int = 8192
    short_budget_tokens: int = 1 << 20
    short_max_requests: int = 512
    long_budget_tokens: int = 1 << 20
    long_max_requests: int = 16
    bytes_per_token: float = 4.0
    default_max_tokens: int = 4096
    retry_after: float = 1.0
    max_request_bytes: int = MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("give at least one --replica URL")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"a replica is an http(s) URL, got {url!r}")
        if self.bytes_per_token <= 0 or self.health_interval <= 0 or self.fail_after < 1:
            raise ValueError("bytes_per_token and health_interval must be positive, fail_after at least 1")
