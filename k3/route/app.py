"""The router's HTTP app: every request is admitted, given its conversation's replica, and proxied there.

`create_router_app(RouterConfig)` serves `/v1/chat/completions`, `/v1/completions`, `/v1/responses` (and every
other path of `k3 serve`, passed to a replica as it is), `/health` (the router's own) and `/metrics` (the
router's Prometheus text). A proxied request keeps its method, path, query, body and headers (hop-by-hop
headers aside; `x-request-id` is added when the client sent none, so the replica's logs and the client see the
same id); the response's status, headers and body bytes come back as the replica sent them, chunk by chunk as
they arrive (SSE included), with `x-k3-replica` naming the replica that answered.

Failover: a request that cannot connect to a replica (or whose connection drops before the response's headers
came) goes to the next replica of its key's order (the pre-assigned secondary first), so a dead primary costs a
re-prefill, never a failed request. Once the headers are sent a failure cannot be hidden: a stream then gets
one `data: {"error": …}` event, as `k3 serve` sends for its own mid-stream failures, and ends. A replica that
takes the request but sends nothing for `read_timeout` seconds is a 504, not retried (it may still be generating).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from k3.route.admission import CLASSES, Admission, ClassBudget, estimate_tokens
from k3.route.config import RouterConfig
from k3.route.fleet import Fleet
from k3.route.ring import affinity_key
from k3.serve.errors import APIError

log = logging.getLogger("k3.route")

# headers of one connection, not of the message (RFC 9110 §7.6.1), and those the proxy sets itself
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
              "trailer", "transfer-encoding", "upgrade", "host", "content-length"}
RESPONSE_SKIP = {"connection", "keep-alive", "transfer-encoding", "date", "server", "proxy-connection"}
# connection failures before a response: nothing was generated for the client, so another replica may answer
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
             httpx.PoolTimeout)
RESPONSE_IDS = 4096  # response id → conversation key, for `previous_response_id` (least recently used dropped)
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')
OFFLOAD_BYTES = 1 << 20  # bodies over this are parsed in a worker thread, off the event loop


@dataclass
class Counters:
    """What `/metrics` reports beyond the replicas' own counts."""

    keyed: int = 0  # requests with a conversation key
    affinity_hits: int = 0  # … answered by their key's ring primary
    failovers: int = 0  # … answered by another replica (the primary down or unreachable)
    retries: int = 0  # connection failures retried on the next replica
    no_replica: int = 0  # 503s: no replica up or none answered
    mid_stream_failures: int = 0
    by_path: dict[str, int] = field(default_factory=dict)


class Router:
    """The proxy: admission, the replica order, the forwarding and the counters."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.fleet = Fleet(config.replicas, config.balance, config.health_interval, config.health_timeout,
                           config.fail_after, config.vnodes)
        budgets = {"short": ClassBudget(config.short_budget_tokens, config.short_max_requests),
                   "long": ClassBudget(config.long_budget_tokens, config.long_max_requests)}
        self.admission = Admission(budgets, config.long_threshold)
        self.counters = Counters()
        self.response_keys: OrderedDict[str, str] = OrderedDict()
        self.client: httpx.AsyncClient | None = None
        self._watch: asyncio.Task | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        timeout = httpx.Timeout(connect=self.config.connect_timeout, read=self.config.read_timeout, write=60.0,
                                pool=self.config.connect_timeout)
        # keep-alive expiry under uvicorn's 5 s, so the router never reuses a connection the replica just closed
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            self.client = client
            await self.fleet.check_all(client)
            self._watch = asyncio.create_task(self.fleet.watch(client))
            try:
                yield
            finally:
                self._watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._watch

    # -- the request path ---------------------------------------------------------------------------------------

    async def proxy(self, request: Request) -> Response:
        path = request.url.path
        self.counters.by_path[path] = self.counters.by_path.get(path, 0) + 1
        request_id = request.headers.get("x-request-id") or "req_" + uuid.uuid4().hex
        try:
            body = await self._read_body(request)
        except APIError as e:
            return _error(e, request_id)
        parsed = None
        if request.method == "POST" and body:
            try:
                parsed = (await asyncio.to_thread(json.loads, body)) if len(body) > OFFLOAD_BYTES else json.loads(body)
            except ValueError:
                parsed = None  # the replica answers malformed JSON with its own 400
        key = self._key(path, parsed, request)
        generating = request.method == "POST" and path in ("/v1/chat/completions", "/v1/completions",
                                                           "/v1/responses")
        cls, estimate = None, 0
        if generating:
            estimate = estimate_tokens(len(body), parsed, self.config.bytes_per_token, self.config.default_max_tokens)
            cls = self.admission.request_class(estimate)
            why = self.admission.admit(cls, estimate)
            if why is not None:
                return _error(self._retry_error(429, f"{why}; retry later", "rate_limit_error",
                                                "rate_limit_exceeded"), request_id)
        release = _Once(lambda: self.admission.release(cls, estimate) if cls else None)
        try:
            return await self._forward(request, body, key, request_id, release)
        except BaseException:
            release()
            raise

    def _key(self, path: str, parsed, request: Request) -> str | None:
        headers = {k.lower(): v for k, v in request.headers.items()}
        if path.startswith("/v1/responses/"):
            rid = path.rsplit("/", 1)[1]
            return self.response_keys.get(rid, "response:" + rid)
        if path == "/v1/responses" and isinstance(parsed, dict) and isinstance(parsed.get("previous_response_id"), str):
            rid = parsed["previous_response_id"]
            if not headers.get(self.config.session_header.lower()):
                return self.response_keys.get(rid, "response:" + rid)
        return affinity_key(path, parsed, headers, self.config.session_header, self.config.prefix_chars)

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is {declared} bytes, over the limit of {limit}",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _retry_error(self, status: int, message: str, kind: str, code: str) -> APIError:
        retry = self.config.retry_after
        headers = {"Retry-After": str(max(1, math.ceil(retry))), "retry-after-ms": str(int(retry * 1000))}
        return APIError(status, message, kind, code=code, headers=headers)

    async def _forward(self, request: Request, body: bytes, key: str | None, request_id: str, release) -> Response:
        order, primary = self.fleet.order(key)
        if not order:
            self.counters.no_replica += 1
            release()
            return _error(self._retry_error(503, "no replica is up: " + self._down_summary(), "overloaded_error",
                                            "no_healthy_replica"), request_id)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        if "x-request-id" not in request.headers:
            headers.append(("x-request-id", request_id))
        client_host = request.client.host if request.client else ""
        forwarded = request.headers.get("x-forwarded-for")
        headers = [(k, v) for k, v in headers if k.lower() != "x-forwarded-for"]
        headers.append(("x-forwarded-for", f"{forwarded}, {client_host}" if forwarded else client_host))
        failures = []
        for replica in order:
            upstream_request = self.client.build_request(request.method, replica.url + request.url.path,
                                                         params=request.url.query or None, headers=headers,
                                                         content=body)
            replica.in_flight += 1
            try:
                upstream = await self.client.send(upstream_request, stream=True)
            except RETRYABLE as e:
                replica.in_flight -= 1
                failures.append(f"{replica.url}: {type(e).__name__}")
                if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                    replica.connect_failures += 1
                    self.fleet.mark_down(replica, f"connect failed: {e}")
                self.counters.retries += 1
                continue
            except httpx.HTTPError as e:
                # a timeout (the replica may still be working on it) or a broken response: not retried
                replica.in_flight -= 1
                release()
                status, code = (504, "replica_timeout") if isinstance(e, httpx.TimeoutException) else (502, "bad_gateway")
                return _error(APIError(status, f"replica {replica.url} failed: {type(e).__name__}: {e}",
                                       "server_error", code=code), request_id)
            except BaseException:
                replica.in_flight -= 1
                raise
            replica.requests += 1
            if key is not None and primary is not None:
                self.counters.keyed += 1
                if replica.url == primary:
                    self.counters.affinity_hits += 1
                else:
                    self.counters.failovers += 1
            return self._relay(upstream, replica, key, request.url.path, request_id, release)
        self.counters.no_replica += 1
        release()
        return _error(self._retry_error(503, "no replica answered (" + "; ".join(failures) + ")",
                                        "overloaded_error", "no_healthy_replica"), request_id)

    def _relay(self, upstream: httpx.Response, replica, key: str | None, path: str, request_id: str,
               release) -> Response:
        is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        remember = key is not None and path == "/v1/responses" and upstream.status_code == 200

        def done():
            replica.in_flight -= 1
            release()

        finish = _Once(done)

        async def chunks():
            head, looking = b"", remember
            try:
                async for chunk in upstream.aiter_raw():
                    if looking:
                        # the id opens a response body and the first event of a stream
                        head += chunk
                        if match := RESPONSE_ID.search(head):
                            self._remember(match.group(1).decode(), key)
                        looking = match is None and len(head) < 8192
                    yield chunk
            except httpx.HTTPError as e:
                self.counters.mid_stream_failures += 1
                log.warning("replica %s failed mid-response: %s", replica.url, e)
                if is_sse:
                    error = APIError(502, f"the replica serving this stream failed: {type(e).__name__}",
                                     "server_error", code="replica_failed")
                    yield b"data: " + json.dumps(error.body()).encode() + b"\n\n"
            finally:
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
                finish()

        response = StreamingResponse(chunks(), status_code=upstream.status_code)
        response.raw_headers = [(k, v) for k, v in upstream.headers.raw if k.lower().decode() not in RESPONSE_SKIP]
        response.raw_headers.append((b"x-k3-replica", replica.url.encode()))
        if "x-request-id" not in upstream.headers:
            response.raw_headers.append((b"x-request-id", request_id.encode()))
        response.background = _Background(finish)
        return response

    def _remember(self, response_id: str, key: str) -> None:
        self.response_keys[response_id] = key
        self.response_keys.move_to_end(response_id)
        while len(self.response_keys) > RESPONSE_IDS:
            self.response_keys.popitem(last=False)

    def _down_summary(self) -> str:
        return "; ".join(f"{r.url} ({r.last_error or 'down'})" for r in self.fleet.replicas.values())

    # -- the router's own endpoints -----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        replicas = [{"url": r.url, "up": r.up, "in_flight": r.in_flight} for r in self.fleet.replicas.values()]
        up = any(r["up"] for r in replicas)
        return JSONResponse({"status": "ok" if up else "unavailable", "replicas": replicas},
                            status_code=200 if up else 503)

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(self.prometheus(), media_type="text/plain; version=0.0.4")

    def prometheus(self) -> str:
        c, out = self.counters, []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP k3_route_{name} {help_}", f"# TYPE k3_route_{name} {kind}"])
            out.extend(f"k3_route_{name}{labels} {value:g}" for labels, value in samples)

        replicas = list(self.fleet.replicas.values())

        def per_replica(attr):
            return [(f'{{replica="{r.url}"}}', float(getattr(r, attr))) for r in replicas]

        metric("replica_up", "gauge", "1 while the replica passes health checks", per_replica("up"))
        metric("replica_in_flight", "gauge", "requests being answered by the replica", per_replica("in_flight"))
        metric("replica_requests_total", "counter", "requests the replica answered", per_replica("requests"))
        metric("replica_connect_failures_total", "counter", "requests that could not connect to the replica",
               per_replica("connect_failures"))
        metric("replica_downs_total", "counter", "times the replica was marked down", per_replica("downs"))
        metric("keyed_requests_total", "counter", "requests with a conversation key", [("", c.keyed)])
        metric("affinity_hits_total", "counter", "keyed requests answered by their ring primary",
               [("", c.affinity_hits)])
        metric("affinity_hit_rate", "gauge", "affinity hits over keyed requests",
               [("", c.affinity_hits / c.keyed if c.keyed else 0.0)])
        metric("failovers_total", "counter", "keyed requests answered by a replica other than their primary",
               [("", c.failovers)])
        metric("retries_total", "counter", "connection failures retried on the next replica", [("", c.retries)])
        metric("mid_stream_failures_total", "counter", "responses cut by a replica failing after the headers",
               [("", c.mid_stream_failures)])
        rejections = [(f'{{reason="budget",class="{k}"}}', float(self.admission.rejected[k])) for k in CLASSES]
        metric("rejections_total", "counter", "requests refused by the router (429 budget, 503 no replica)",
               rejections + [('{reason="no_replica"}', float(c.no_replica))])
        metric("class_in_flight_requests", "gauge", "admitted requests in flight per class",
               [(f'{{class="{k}"}}', float(self.admission.requests[k])) for k in CLASSES])
        metric("class_in_flight_tokens", "gauge", "estimated tokens in flight per class",
               [(f'{{class="{k}"}}', float(self.admission.tokens[k])) for k in CLASSES])
        metric("requests_total", "counter", "requests received, by path",
               [(f'{{path="{p}"}}', float(n)) for p, n in sorted(c.by_path.items())])
        return "\n".join(out) + "\n"


class _Once:
    """Calls `fn` the first time it is called, never again (a response ends by its stream or its background)."""

    def __init__(self, fn):
        self.fn, self.called = fn, False

    def __call__(self):
        if not self.called:
            self.called = True
            self.fn()


class _Background:
    """A Starlette background task that runs `fn` (synchronous, quick) after the response was sent."""

    def __init__(self, fn):
        self.fn = fn

    async def __call__(self):
        self.fn()


def _error(e: APIError, request_id: str) -> Response:
    response = e.response()
    response.headers["x-request-id"] = request_id
    return response


def create_router_app(config: RouterConfig) -> Starlette:
    """The router's ASGI app; its lifespan opens the connection pool and starts the health checks."""
    router = Router(config)
    routes = [Route("/health", router.health, methods=["GET"]),
              Route("/metrics", router.metrics, methods=["GET"]),
              Route("/{path:path}", router.proxy, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])]
    app = Starlette(routes=routes, lifespan=router.lifespan)
    app.state.router = router
    return app
