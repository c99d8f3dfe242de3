"""`k3 route` on loopback: three real `k3 serve` replicas (the debug preset, random weights, each its own
engine) and scripted fake replicas, behind a real router, driven by the official `openai` client.

Replicas and router are uvicorn servers on threads of this process (`tests.serve.conftest.LiveServer`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from k3.infer.config import EngineConfig
from k3.route.app import create_router_app
from k3.route.config import RouterConfig
from k3.route.ring import affinity_key
from tests.serve.conftest import MODEL_NAME, LiveServer, make_engine, model, serve  # noqa: F401 (model: fixture)

BLOCK = EngineConfig().hash_block_size  # the prefix cache matches whole blocks of this many tokens
FAST_HEALTH = {"health_interval": 0.2, "health_timeout": 1.0, "fail_after": 1}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


class Fleet:
    """Three real replicas on one shared model, each with its own engine and prefix cache."""

    def __init__(self, shared_model, tokenizer, n: int = 3):
        self.engines = [make_engine(shared_model, tokenizer) for _ in range(n)]
        self.servers = [serve(e, tokenizer).__enter__() for e in self.engines]
        self.urls = [s.base_url for s in self.servers]

    def kill(self, url: str) -> None:
        i = self.urls.index(url)
        self.servers[i].__exit__(None, None, None)
        self.engines[i].shutdown()

    def close(self) -> None:
        for server, engine in zip(self.servers, self.engines):
            if server.thread.is_alive():
                server.__exit__(None, None, None)
                engine.shutdown()


@pytest.fixture(scope="module")
def fleet(model, tokenizer):  # noqa: F811
    fleet = Fleet(model, tokenizer)
    yield fleet
    fleet.close()


def router(urls: list[str], **options) -> LiveServer:
    return LiveServer(create_router_app(RouterConfig(replicas=urls, **options)))


def converse(c: openai.OpenAI, system: str, turns: list[str], on_turn=None, **extra):
    """Run a multi-turn chat; per turn: (replica that answered, prompt tokens, cached tokens)."""
    messages, seen = [{"role": "system", "content": system}], []
    for i, text in enumerate(turns):
        if on_turn:
            on_turn(i)
        messages.append({"role": "user", "content": text})
        raw = c.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                                           temperature=0, **extra)
        r = raw.parse()
        seen.append((raw.headers["x-k3-replica"], r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    return seen, messages


def gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


TURNS = ["Tell me about the weather in Paris.", "And tomorrow?", "What should I wear?", "Thanks, and on Sunday?"]


def test_affinity_keeps_a_conversation_on_its_replica_and_its_cache(fleet):
    system = "You are a weather assistant (affinity test)."
    with router(fleet.urls, **FAST_HEALTH) as r:
        seen, messages = converse(client(r.base_url), system, TURNS)
        key = affinity_key("/v1/chat/completions", {"messages": messages}, {})
        primary = r.server.config.app.state.router.fleet.ring.primary(key)
        assert {replica for replica, _, _ in seen} == {primary}
        for (_, prev_prompt, _), (_, _, cached) in itertools.pairwise(seen):
            # every later turn finds the previous prompt in the cache, in whole hash blocks
            assert cached >= prev_prompt // BLOCK * BLOCK > 0, seen
        m = gauges(r.base_url)
        assert m["k3_route_affinity_hits_total"] == 4 and m["k3_route_affinity_hit_rate"] == 1.0
        assert m[f'k3_route_replica_requests_total{{replica="{primary}"}}'] == 4

    # the same conversation over a plain least-loaded balancer: turns land elsewhere and miss the cache
    with router(fleet.urls, balance="least-loaded", **FAST_HEALTH) as r:
        seen, _ = converse(client(r.base_url), system.replace("affinity", "no affinity"), TURNS)
        assert len({replica for replica, _, _ in seen}) == 3
        assert sum(cached for _, _, cached in seen) < 0.5 * sum(prompt for _, prompt, _ in seen[1:])


def test_streaming_passes_through_unchanged(fleet):
    body = {"model": MODEL_NAME, "messages": [{"role": "system", "content": "streaming test"},
                                              {"role": "user", "content": "Count to ten."}],
            "max_tokens": 12, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with router(fleet.urls, **FAST_HEALTH) as r:
        c = client(r.base_url)
        raw = c.chat.completions.with_raw_response.create(**body)
        via_router = list(raw.parse())
        replica = raw.headers["x-k3-replica"]
        assert raw.headers["content-type"].startswith("text/event-stream")
        direct = list(client(replica).chat.completions.create(**body))

    def text(chunks):
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    assert text(via_router) == text(direct) and len(via_router) == len(direct)
    assert via_router[-1].usage.completion_tokens == direct[-1].usage.completion_tokens


def test_a_client_leaving_mid_stream_aborts_the_replica_request(fleet):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "a long story (disconnect test)"}],
            "max_tokens": 800, "temperature": 0, "stream": True}
    generated = {url: gauges(url)["k3_generation_tokens_total"] for url in fleet.urls}
    with router(fleet.urls, **FAST_HEALTH) as r:
        with httpx.stream("POST", r.base_url + "/v1/chat/completions", json=body, timeout=60) as resp:
            replica = resp.headers["x-k3-replica"]
            events = 0
            for line in resp.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break  # leaving the block closes the connection mid-stream
        deadline = time.monotonic() + 10
        while gauges(replica)["k3_requests_running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        m = gauges(replica)
        assert m["k3_requests_running"] == 0 and m["k3_kv_pages_used"] == 0, m
        assert m["k3_generation_tokens_total"] - generated[replica] < 400  # the replica stopped generating
        deadline = time.monotonic() + 5
        in_flight = f'k3_route_replica_in_flight{{replica="{replica}"}}'
        while gauges(r.base_url)[in_flight] and time.monotonic() < deadline:
            time.sleep(0.05)
        routed = gauges(r.base_url)
        assert routed[in_flight] == 0
        assert routed['k3_route_class_in_flight_requests{class="short"}'] == 0


# -- scripted replicas: exact bytes, timing, failures ---------------------------------------------------------------

CHUNKS = [b'data: {"n": 1}\n\n', b": ping\n\n", b'data: {"n": 2, "text": "caf\xc3\xa9"}\n\n', b"data: [DONE]\n\n"]


def scripted_replica(name: str, gap: float = 0.15, die_after: int | None = None, hold: float = 0.0) -> LiveServer:
    """A replica that streams `CHUNKS` `gap` s apart (dying after `die_after` of them), or answers JSON after
    `hold` s; it echoes the request it got."""
    async def health(request):
        return JSONResponse({"status": "ok"})

    async def chat(request):
        body = await request.json()
        if not body.get("stream"):
            await asyncio.sleep(hold)
            return JSONResponse({"replica": name, "headers": dict(request.headers), "body": body,
                                 "query": str(request.url.query)}, headers={"x-custom": "kept"})

        async def events():
            for i, chunk in enumerate(CHUNKS):
                if die_after is not None and i == die_after:
                    raise RuntimeError("replica died")
                yield chunk
                await asyncio.sleep(gap)

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/health", health), Route("/v1/chat/completions", chat, methods=["POST"])])
    return LiveServer(app)


def dead_url() -> str:
    """A loopback URL where nothing listens (connections are refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_stream_bytes_and_chunk_timing_pass_through():
    with scripted_replica("a") as a, router([a.base_url]) as r:
        got, times = [], []
        start = time.monotonic()
        with httpx.stream("POST", r.base_url + "/v1/chat/completions", json=CHAT | {"stream": True}) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            for chunk in resp.iter_raw():
                got.append(chunk)
                times.append(time.monotonic() - start)
    assert b"".join(got) == b"".join(CHUNKS)
    # chunks arrive as the replica sends them, not buffered to the end
    assert len(got) >= 3 and times[0] < 0.12 and times[-1] - times[0] > 0.3, times


def test_request_and_response_are_proxied_faithfully():
    with scripted_replica("a") as a, router([a.base_url]) as r:
        resp = httpx.post(r.base_url + "/v1/chat/completions?foo=bar", json=CHAT | {"extra": [1, 2]},
                          headers={"authorization": "Bearer k", "x-request-id": "abc", "x-other": "1"})
    echo = resp.json()
    assert resp.status_code == 200 and resp.headers["x-custom"] == "kept" and resp.headers["x-request-id"] == "abc"
    assert resp.headers["x-k3-replica"] == a.base_url
    assert echo["body"] == CHAT | {"extra": [1, 2]} and echo["query"] == "foo=bar"
    assert echo["headers"]["authorization"] == "Bearer k" and echo["headers"]["x-other"] == "1"
    assert echo["headers"]["x-forwarded-for"] == "127.0.0.1"


def test_connect_failure_goes_to_the_secondary_without_a_failed_request():
    with scripted_replica("a") as a, scripted_replica("b") as b:
        dead = dead_url()
        # health checks too slow to notice: the request itself finds the primary dead
        with router([dead, a.base_url, b.base_url], health_interval=60.0) as r:
            app_router = r.server.config.app.state.router
            app_router.fleet.replicas[dead].up = True  # as if it died after the last check
            key = next(f"k{i}" for i in range(1000) if app_router.fleet.ring.primary("session:" + f"k{i}") == dead)
            resp = client(r.base_url).chat.completions.with_raw_response.create(
                **CHAT, extra_headers={"x-session-id": key})
            assert resp.http_response.status_code == 200
            secondary = app_router.fleet.ring.owners("session:" + key)[1]
            assert resp.headers["x-k3-replica"] == secondary
            m = gauges(r.base_url)
    assert m["k3_route_failovers_total"] == 1 and m["k3_route_retries_total"] == 1
    assert m[f'k3_route_replica_up{{replica="{dead}"}}'] == 0


def test_a_replica_failing_mid_stream_sends_an_error_event():
    with scripted_replica("a", gap=0.01, die_after=2) as a, router([a.base_url]) as r:
        with httpx.stream("POST", r.base_url + "/v1/chat/completions", json=CHAT | {"stream": True}) as resp:
            text = b"".join(resp.iter_raw())
        m = gauges(r.base_url)
    assert text.startswith(b"".join(CHUNKS[:2]))
    error = json.loads(text.split(b"data: ")[-1])
    assert error["error"]["code"] == "replica_failed"
    assert m["k3_route_mid_stream_failures_total"] == 1


def test_over_budget_is_a_429_with_retry_after():
    with scripted_replica("a", hold=1.0) as a, router([a.base_url], short_max_requests=1, retry_after=2.0) as r:
        async def main():
            async with httpx.AsyncClient(base_url=r.base_url, timeout=30) as http:
                first = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 5}))
                await asyncio.sleep(0.3)
                c = openai.AsyncOpenAI(base_url=r.base_url + "/v1", api_key="none", max_retries=0)
                with pytest.raises(openai.RateLimitError) as refused:
                    await c.chat.completions.create(**CHAT, max_tokens=5)
                return (await first), refused.value

        first, refused = asyncio.run(main())
        assert first.status_code == 200
        assert refused.response.headers["retry-after"] == "2" and refused.response.headers["retry-after-ms"] == "2000"
        assert refused.body["code"] == "rate_limit_exceeded" and "short requests" in refused.body["message"]
        # the budget was given back: the next request is admitted
        assert httpx.post(r.base_url + "/v1/chat/completions", json=CHAT).status_code == 200
        m = gauges(r.base_url)
        assert m['k3_route_rejections_total{reason="budget",class="short"}'] == 1
        assert m['k3_route_class_in_flight_requests{class="short"}'] == 0


def test_long_class_has_its_own_budget():
    with scripted_replica("a", hold=1.0) as a, router([a.base_url], long_threshold=100, long_max_requests=1) as r:
        async def main():
            async with httpx.AsyncClient(base_url=r.base_url, timeout=30) as http:
                first = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 500}))
                await asyncio.sleep(0.3)
                long, short = await asyncio.gather(http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 500}),
                                                   http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 5}))
                return await first, long, short

        first, long, short = asyncio.run(main())
    assert first.status_code == 200 and short.status_code == 200
    assert long.status_code == 429 and "long requests" in long.json()["error"]["message"]


def test_a_replica_too_slow_to_answer_is_a_504_not_retried():
    with (scripted_replica("a", hold=2.0) as a, scripted_replica("b") as b,
          router([a.base_url, b.base_url], read_timeout=0.5, balance="least-loaded") as r):
        app_router = r.server.config.app.state.router
        app_router.fleet.replicas[b.base_url].in_flight = 1  # so the slow replica is tried first
        resp = httpx.post(r.base_url + "/v1/chat/completions", json=CHAT, timeout=30)
        m = gauges(r.base_url)
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "replica_timeout"
    assert m["k3_route_retries_total"] == 0 and m['k3_route_class_in_flight_requests{class="short"}'] == 0


def test_no_replica_up_is_a_503():
    with router([dead_url(), dead_url()], **FAST_HEALTH) as r:
        with pytest.raises(openai.InternalServerError) as refused:
            client(r.base_url).chat.completions.create(**CHAT)
        health = httpx.get(r.base_url + "/health")
    assert refused.value.status_code == 503 and refused.value.body["code"] == "no_healthy_replica"
    assert refused.value.response.headers["retry-after"] == "1"
    assert health.status_code == 503 and not any(x["up"] for x in health.json()["replicas"])


def test_killing_the_primary_mid_conversation_moves_it_to_the_secondary(model, tokenizer):  # noqa: F811
    fleet = Fleet(model, tokenizer)
    try:
        with router(fleet.urls, **FAST_HEALTH) as r:
            fleet_state = r.server.config.app.state.router.fleet
            system = "You are a weather assistant (failover test)."
            key = affinity_key("/v1/chat/completions", {"messages": [{"role": "system", "content": system},
                                                                      {"role": "user", "content": TURNS[0]}]}, {})
            primary, secondary = fleet_state.ring.owners(key)[:2]

            def kill_before_third_turn(i):
                if i == 2:
                    fleet.kill(primary)

            seen, _ = converse(client(r.base_url), system, TURNS, on_turn=kill_before_third_turn)
            m = gauges(r.base_url)
        assert [s[0] for s in seen] == [primary, primary, secondary, secondary]
        assert seen[1][2] > 0 and seen[2][2] < seen[1][1]  # the secondary re-prefilled what the primary held
        assert seen[3][2] >= seen[2][1] // BLOCK * BLOCK  # and holds it for the next turn
        assert m["k3_route_failovers_total"] == 2 and m[f'k3_route_replica_up{{replica="{primary}"}}'] == 0
    finally:
        fleet.close()


def test_responses_chain_stays_on_the_replica_that_stored_it(fleet):
    with router(fleet.urls, **FAST_HEALTH) as r:
        c = client(r.base_url)
        first = c.responses.with_raw_response.create(model=MODEL_NAME, input="Remember the number 7.", store=True,
                                                     max_output_tokens=4, temperature=0)
        second = c.responses.with_raw_response.create(model=MODEL_NAME, input="Which number?",
                                                      previous_response_id=first.parse().id, max_output_tokens=4, store=True,
                                                      temperature=0)
        assert second.http_response.status_code == 200
        assert second.headers["x-k3-replica"] == first.headers["x-k3-replica"]
        assert c.responses.retrieve(second.parse().id).id == second.parse().id
        assert [m.id for m in c.models.list()] == [MODEL_NAME]


def test_cli_refuses_a_bad_replica_url(capsys):
    from k3.cli import main

    assert main(["route", "--replica", "ftp://10.0.0.1:8000", "--port", "9000"]) == 2
    assert "http(s) URL" in capsys.readouterr().err
