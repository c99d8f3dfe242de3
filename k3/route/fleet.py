"""The replicas behind the router: their health, their load, and the order a request tries them in.

A replica is up until `fail_after` health checks in a row fail (`GET /health` every `health_interval`
seconds), or at once when a request cannot connect to it; one passing check brings it back. The ring never
changes when a replica goes down: its keys fail over to their secondaries and return to it when it is back
(where their prefix cache may still be).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

import httpx

from k3.route.config import Balance
from k3.route.ring import VIRTUAL_NODES, Ring

log = logging.getLogger("k3.route")



@dataclass
class Replica:
    """One `k3 serve` behind the router, and what the router counts about it."""

    url: str
    up: bool = True
    failed_checks: int = 0
    in_flight: int = 0
    requests: int = 0  # requests it answered (any status)
    connect_failures: int = 0
    downs: int = 0  # times it was marked down
    last_error: str = ""


@dataclass
class Fleet:
    """The replicas, the ring over them and the health checker."""

    urls: list[str]
    balance: Balance = "affinity"
    health_interval: float = 1.0
    health_timeout: float = 2.0
    fail_after: int = 3
    vnodes: int = VIRTUAL_NODES
    replicas: dict[str, Replica] = field(init=False)

    def __post_init__(self) -> None:
        self.urls = [u.rstrip("/") for u in self.urls]
        self.ring = Ring(self.urls, self.vnodes)
        self.replicas = {u: Replica(u) for u in self.urls}
        self._turn = itertools.count()

    def order(self, key: str | None) -> tuple[list[Replica], str | None]:
        """(the up replicas in the order to try them, the key's ring primary or None).

        With affinity and a key: the key's ring order (primary, secondary, …); otherwise the least loaded first,
        ties taken in turn."""
        if key is not None and self.balance == "affinity":
            owners = self.ring.owners(key)
            return [self.replicas[u] for u in owners if self.replicas[u].up], owners[0]
        turn = next(self._turn)
        up = [r for r in self.replicas.values() if r.up]
        up = up[turn % len(up):] + up[: turn % len(up)] if up else up
        return sorted(up, key=lambda r: r.in_flight), None

    def mark_down(self, replica: Replica, why: str) -> None:
        replica.failed_checks = max(replica.failed_checks, self.fail_after)
        replica.last_error = why
        if replica.up:
            replica.up = False
            replica.downs += 1
            log.warning("replica %s is down: %s", replica.url, why)

    async def check(self, client: httpx.AsyncClient, replica: Replica) -> None:
        try:
            r = await client.get(replica.url + "/health", timeout=self.health_timeout)
            ok, why = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, why = False, f"/health failed: {type(e).__name__}: {e}"
        if ok:
            if not replica.up:
                log.warning("replica %s is back", replica.url)
            replica.up, replica.failed_checks = True, 0
            return
        replica.failed_checks += 1
        replica.last_error = why
        if replica.failed_checks >= self.fail_after:
            self.mark_down(replica, why)

    async def check_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.check(client, r) for r in self.replicas.values()))

    async def watch(self, client: httpx.AsyncClient) -> None:
        """Check every replica every `health_interval` seconds, forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.health_interval)
            await self.check_all(client)
