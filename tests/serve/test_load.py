"""A bounded load test on loopback: 64 concurrent streaming clients, zero errors, and afterwards every
sequence slot and KV page freed (read from the engine's own metrics on `/metrics`); clients that
disconnect mid-stream free theirs too."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.serve.conftest import MODEL_NAME, make_engine, real_engine_available, serve

CLIENTS = 64


def _gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def _wait_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    keys = ["k3_requests_running", "k3_requests_waiting"]
    if real_engine_available():
        keys += ["k3_kv_pages_used", "k3_kda_slots_used"]
    deadline = time.monotonic() + timeout
    while True:
        g = _gauges(url)
        if all(g[k] == 0 for k in keys) or time.monotonic() > deadline:
            return {k: g[k] for k in keys} | g
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    engine = make_engine(model, tokenizer)
    try:
        with serve(engine, tokenizer) as s:
            yield engine, s.base_url
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()


def test_64_concurrent_streaming_clients(server):
    engine, url = server

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

        async def one(i: int):
            stream = await client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": f"client {i}: say something"}],
                max_tokens=8, temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            return chunks

        try:
            return await asyncio.gather(*(one(i) for i in range(CLIENTS)), return_exceptions=True)
        finally:
            await client.close()

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for chunks in results:
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and 1 <= usage.completion_tokens <= 8
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    idle = _wait_idle(url)
    assert all(v == 0 for k, v in idle.items() if k in ("k3_requests_running", "k3_requests_waiting",
                                                           "k3_kv_pages_used", "k3_kda_slots_used")), idle
    if real_engine_available():
        assert idle["k3_requests_finished_total"] >= CLIENTS
        assert idle["k3_kv_pages_free"] + idle["k3_kv_pages_cached"] == idle["k3_kv_pages_total"]


def test_disconnects_mid_stream_free_everything(server):
    _, url = server

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async def leave_early(i: int) -> bool:
                body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"long story {i}"}],
                        "max_tokens": 800, "seed": i, "stream": True}
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen >= 3:
                            return True  # leaving the block closes the connection mid-stream
                return False

            return await asyncio.gather(*(leave_early(i) for i in range(16)))

    assert all(asyncio.run(main()))
    idle = _wait_idle(url)
    assert idle["k3_requests_running"] == 0 and idle["k3_requests_waiting"] == 0, idle
    if real_engine_available():
        assert idle["k3_kv_pages_used"] == 0 and idle["k3_kda_slots_used"] == 0, idle
        # 16 × 800 tokens were not generated: the requests really were cut short
        assert idle["k3_generation_tokens_total"] < CLIENTS * 8 + 16 * 100
