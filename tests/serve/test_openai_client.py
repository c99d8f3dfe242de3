"""The official `openai` client (sync and async) against a real uvicorn server on loopback (docs/serving.md).

`live` serves the engine the product ships; `fake` serves the scriptable test engine, used where a random
model cannot be relied on to write something (tool calls, JSON, a think channel) or to refuse a request.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from pydantic import BaseModel

from k3.chat.template import ChatTemplate
from k3.infer.api import AdmissionError
from k3.infer.generate import generate
from tests.serve.conftest import MODEL_NAME, real_engine_available, serve

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def client(base_url: str, **kw) -> openai.OpenAI:
    kw.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=base_url + "/v1", api_key=kw.pop("api_key", "none"), **kw)


def aclient(base_url: str, **kw) -> openai.AsyncOpenAI:
    kw.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", **kw)


def reply_tokens(template: ChatTemplate, message: dict, thinking: bool = False) -> list[int]:
    """What a model would write after the generation prompt to produce `message`."""
    head = template.open_tag("think" if thinking else "response")
    return template.assistant_body(message, thinking=thinking)[len(head):] + [template.end_id]


@pytest.fixture(scope="module")
def template(tokenizer):
    return ChatTemplate(tokenizer)


def test_models(live):
    _, url = live
    c = client(url)
    assert [m.id for m in c.models.list()] == [MODEL_NAME]
    assert c.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")


def test_chat_sync_usage_and_headers(live, template):
    _, url = live
    raw = client(url).chat.completions.with_raw_response.create(model=MODEL_NAME, messages=USER, max_tokens=6,
                                                                 temperature=0)
    assert raw.headers["x-request-id"]
    r = raw.parse()
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL_NAME
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(template.render(USER))
    assert 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_greedy_equals_reference_decoding(live, model, tokenizer):
    _, url = live
    prompt = [tokenizer.bos_id] + tokenizer.encode("the cat sat on the mat")
    r = client(url).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0)
    ref = list(generate(model, prompt, 10, temperature=0.0, stop_ids=set(tokenizer.stop_ids)))
    expected = tokenizer.decode([t for t in ref if not tokenizer.is_special(t)])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == ("length" if len(ref) == 10 else "stop")


def test_seed_reproducibility_and_n(live):
    _, url = live
    c = client(url)

    def run(**kw):
        r = c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=8, temperature=1.0, **kw)
        return [(ch.message.content, ch.message.reasoning_content if hasattr(ch.message, "reasoning_content")
                 else None) for ch in r.choices], r

    a, _ = run(seed=1234)
    b, _ = run(seed=1234)
    assert a == b
    outs = {run(seed=s)[0][0] for s in range(1234, 1238)}
    assert len(outs) > 1  # different seeds, different samples
    three, r = run(seed=1234, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert three[0] == a[0]  # choice i uses seed + i
    assert 3 <= r.usage.completion_tokens <= 24


def test_streaming_with_usage(live, template):
    _, url = live
    stream = client(url).chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}, n=2)
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.prompt_tokens == len(template.render(USER))
    assert all(c.usage is None for c in chunks[:-1])
    for i in range(2):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert mine[-1].finish_reason in ("stop", "length") and all(m.finish_reason is None for m in mine[:-1])
    # greedy: both choices and the non-streaming call agree
    text = ["".join(c.choices[0].delta.content or "" for c in chunks[:-1] if c.choices[0].index == i) for i in (0, 1)]
    again = client(url).chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=6, temperature=0)
    assert text[0] == text[1] == (again.choices[0].message.content or "")


def test_raw_sse_order(live):
    _, url = live
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"]
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] is not None and chunks[-2]["choices"][0]["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_async_client_concurrent(live):
    _, url = live

    async def main():
        c = aclient(url)
        one = c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=5, temperature=0)

        async def streamed():
            s = await c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=5, temperature=0,
                                                stream=True)
            return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])

        results = await asyncio.gather(one, streamed(), streamed())
        await c.close()
        return results

    r, s1, s2 = asyncio.run(main())
    assert (r.choices[0].message.content or "") == s1 == s2


def _visible_stop(text: str) -> str | None:
    for k in range(2, len(text) - 1):
        piece = text[k:k + 2]
        if "\ufffd" not in piece and piece.strip():
            return piece
    return None


def test_stop_strings(live):
    _, url = live
    c = client(url)
    prompt = "the cat sat"
    full = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    stop = _visible_stop(full)
    if stop is None:
        pytest.skip(f"the random model wrote too little visible text: {full!r}")
    cut = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "\x00"])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                    stream=True)
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks) == full[:full.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # chat: the stop applies to the reply's content
    chat = c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=16, temperature=0)
    content = chat.choices[0].message.content or ""
    stop = _visible_stop(content)
    if stop is not None:
        cut = c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=16, temperature=0, stop=stop)
        assert cut.choices[0].message.content == content[:content.find(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_logprobs(live):
    _, url = live
    c = client(url)
    r = c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=5, temperature=0, logprobs=True,
                                  top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy picks the most likely token
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    r = c.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs)


@pytest.mark.skipif(not real_engine_available(), reason="needs the engine's prefix cache")
def test_cached_tokens_on_repeated_prefix(live):
    _, url = live
    c = client(url)
    long_user = [{"role": "system", "content": "You are a weather bot. " * 12}] + USER
    c.chat.completions.create(model=MODEL_NAME, messages=long_user, max_tokens=2, temperature=0)
    second = c.chat.completions.create(model=MODEL_NAME, messages=long_user + [
        {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Tomorrow?"}], max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens > 0


# ---- scripted replies (the fake engine) -------------------------------------------------------------------

def test_tool_call_loop_streamed(fake, template):
    engine, url = fake
    c = client(url)
    calls = [{"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
             {"id": "y", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    engine.script = [reply_tokens(template, {"role": "assistant", "content": None, "tool_calls": calls}),
                     reply_tokens(template, {"role": "assistant", "content": "It is 21C at noon."})]
    stream = c.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, max_tokens=200, stream=True)
    acc: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            slot = acc.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert slot["id"] is None and tc.type == "function"
                slot["id"], slot["name"] = tc.id, tc.function.name
            slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(acc[i]["name"], json.loads(acc[i]["arguments"])) for i in sorted(acc)] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {})]
    first_prompt = engine.requests[-1][1]
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": acc[i]["id"], "type": "function", "function": {"name": acc[i]["name"], "arguments": acc[i]["arguments"]}}
        for i in sorted(acc)]}]
    messages += [{"role": "tool", "tool_call_id": acc[0]["id"], "content": "21C"},
                 {"role": "tool", "tool_call_id": acc[1]["id"], "content": "12:00"}]
    r = c.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=200)
    assert r.choices[0].message.content == "It is 21C at noon." and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None
    # the follow-up prompt continues the first prompt plus the reply, token for token (prefix-cache friendly)
    second_prompt = engine.requests[-1][1]
    written = engine.requests[-2][1]
    assert second_prompt[:len(first_prompt)] == first_prompt == written


def test_tool_calls_non_streaming_and_options(fake, template):
    engine, url = fake
    c = client(url)
    calls = [{"id": "x", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
             {"id": "y", "function": {"name": "get_time", "arguments": "{}"}}]
    script = reply_tokens(template, {"role": "assistant", "content": "Checking.", "tool_calls": calls})
    engine.script = [script]
    r = c.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, max_tokens=200)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking."
    assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == \
        [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
    assert all(t.id.startswith("call_") and t.type == "function" for t in msg.tool_calls)
    engine.script = [script]
    r = c.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, parallel_tool_calls=False,
                                  max_tokens=200)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    engine.script = [script]
    r = c.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=200)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    # tool_choice is a one-shot option after the history; the request still succeeds with a named function
    engine.script = [script]
    c.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, max_tokens=200,
                              tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "tool-choice" in engine_text(engine, template)


def engine_text(engine, template) -> str:
    return template.tokenizer.decode(engine.requests[-1][1])


def test_reasoning_content_and_effort(fake, template):
    engine, url = fake
    c = client(url)
    engine.script = [reply_tokens(template, {"role": "assistant", "reasoning_content": "Think: 2+2.",
                                             "content": "4"}, thinking=True)]
    r = c.chat.completions.create(model=MODEL_NAME, messages=USER, reasoning_effort="medium", max_tokens=100)
    msg = r.choices[0].message
    assert msg.content == "4" and msg.reasoning_content == "Think: 2+2."
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    assert 'name="thinking-effort"<|sep|>high' in engine_text(engine, template)
    assert engine_text(engine, template).endswith("<|open|>think<|sep|>")
    engine.script = [reply_tokens(template, {"role": "assistant", "reasoning_content": "Hmm.", "content": "Yes"},
                                  thinking=True)]
    chunks = list(c.chat.completions.create(model=MODEL_NAME, messages=USER, reasoning_effort="max", stream=True))
    deltas = [ch.choices[0].delta for ch in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Hmm."
    assert "".join(d.content or "" for d in deltas) == "Yes"


def test_parse_response_format_and_stream_helper(fake, template):
    engine, url = fake
    c = client(url)

    class Weather(BaseModel):
        city: str
        celsius: int

    engine.script = [reply_tokens(template, {"role": "assistant", "content": '{"city":"Paris","celsius":21}'})]
    r = c.chat.completions.parse(model=MODEL_NAME, messages=USER, response_format=Weather, max_tokens=100)
    assert r.choices[0].message.parsed == Weather(city="Paris", celsius=21)
    assert 'name="response-format"' in engine_text(engine, template)
    engine.script = [reply_tokens(template, {"role": "assistant", "content": "streamed helper"})]
    with c.chat.completions.stream(model=MODEL_NAME, messages=USER, max_tokens=100) as s:
        kinds = [e.type for e in s]
        final = s.get_final_completion()
    assert "content.delta" in kinds and final.choices[0].message.content == "streamed helper"


def test_error_classes_and_retry_after(fake, model, tokenizer):
    engine, url = fake
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL_NAME, messages=USER, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=USER)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=10**9)
    assert e.value.body["code"] == "context_length_exceeded"
    for status, cls in ((429, openai.RateLimitError), (503, openai.InternalServerError)):
        engine.refuse = AdmissionError("busy", retry_after=2.5, status=status)
        with pytest.raises(cls) as e:
            c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2)
        assert e.value.response.headers["retry-after"] == "3"
        assert e.value.response.headers["retry-after-ms"] == "2500"
        engine.refuse = AdmissionError("busy", retry_after=2.5, status=status)
        with pytest.raises(cls):  # a stream is refused with a status code, before any SSE
            c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2, stream=True)
    # the client retries after Retry-After (here 0 ms) and then succeeds
    engine.refuse = AdmissionError("busy", retry_after=0.0, status=429)
    start = time.monotonic()
    r = client(url, max_retries=2).chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2)
    assert r.choices and engine.refuse is None and time.monotonic() - start < 5
    with serve(engine, tokenizer, api_key="sekrit") as guarded:
        with pytest.raises(openai.AuthenticationError):
            client(guarded.base_url, api_key="wrong").models.list()
        assert httpx.get(guarded.base_url + "/v1/models").status_code == 401
        assert [m.id for m in client(guarded.base_url, api_key="sekrit").models.list()] == [MODEL_NAME]
        assert httpx.get(guarded.base_url + "/health").status_code == 200


def test_disconnect_mid_stream_aborts(fake):
    engine, url = fake
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 500, "stream": True}
    engine.delay = 1.0  # the request is surely still in the engine when the client leaves
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
    finally:
        engine.delay = 0.0
    request_id = engine.requests[-1][0]
    deadline = time.monotonic() + 10
    while (engine.running or request_id not in engine.aborted_ids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert request_id in engine.aborted_ids and engine.running == 0
    # without streaming (and a slow engine, so the request is still pending): the server polls for the disconnect
    engine.delay = 3.0
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=0.3)
    finally:
        engine.delay = 0.0
    request_id = engine.requests[-1][0]
    deadline = time.monotonic() + 10
    while (engine.running or request_id not in engine.aborted_ids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert request_id in engine.aborted_ids and engine.running == 0


def _sse_events(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_pings_during_slow_prefill_and_engine_failures(fake, tokenizer):
    engine, _ = fake
    with serve(engine, tokenizer, ping_seconds=0.05, admission_wait=0.05) as server:
        engine.delay = 0.3
        try:
            lines = _sse_events(server.base_url, {"messages": USER, "max_tokens": 2, "stream": True})
        finally:
            engine.delay = 0.0
        assert ": ping" in lines and lines[-1] == "data: [DONE]"
        # a failure mid-stream: one error event, then the stream closes (no [DONE])
        engine.fail_after = 2
        lines = _sse_events(server.base_url, {"messages": USER, "max_tokens": 8, "stream": True})
        assert json.loads(lines[-1][len("data: "):])["error"]["type"] == "server_error"
        assert "data: [DONE]" not in lines
        # ... and without streaming, a 500 that the client does not retry (a retry would have succeeded)
        engine.fail_after = 2
        with pytest.raises(openai.InternalServerError) as e:
            client(server.base_url, max_retries=2).chat.completions.create(model=MODEL_NAME, messages=USER,
                                                                         max_tokens=8)
        assert e.value.status_code == 500 and e.value.response.headers["x-should-retry"] == "false"


def test_completions_batch_echo_and_stream(live, tokenizer):
    _, url = live
    c = client(url)
    r = c.completions.create(model=MODEL_NAME, prompt=["the cat", "hello world"], n=2, max_tokens=4, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text
    assert r.usage.prompt_tokens == len(tokenizer.encode("the cat")) + len(tokenizer.encode("hello world")) + 2
    echoed = c.completions.create(model=MODEL_NAME, prompt="the cat", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "the cat" + r.choices[0].text
    chunks = list(c.completions.create(model=MODEL_NAME, prompt=["the cat", "hello world"], max_tokens=4,
                                       temperature=0, stream=True, stream_options={"include_usage": True}))
    texts = ["".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) for i in (0, 1)]
    assert texts == [r.choices[0].text, r.choices[2].text]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == r.usage.prompt_tokens
    assert 2 * usage.completion_tokens == r.usage.completion_tokens  # greedy: n = 2 wrote everything twice
