"""Structured outputs and forced tool calls through the official `openai` client against the real engine with
random weights (constrained decoding: k3/infer/grammar.py, k3/chat/constrain.py), schema checks on arrival, the
request byte limit, `/health` while a huge request is prepared, and requests that can never be admitted.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from tests.serve.conftest import MODEL_NAME, make_engine, real_engine_available, serve

pytestmark = pytest.mark.skipif(not real_engine_available(), reason="needs the real engine")

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 9},
                          "unit": {"enum": ["C", "F"]}},
           "required": ["city", "days", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER,
                                           "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    engine = make_engine(model, tokenizer)
    try:
        with serve(engine, tokenizer, max_request_bytes=16 * 2**20) as s:
            yield s.base_url
    finally:
        engine.shutdown()


def test_json_schema_strict_always_validates(server):
    c = client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    r = c.chat.completions.create(model=MODEL_NAME, messages=USER, response_format=fmt, max_tokens=200,
                                  temperature=1.0, seed=0, n=8)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_json_object_is_an_object(server):
    r = client(server).chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=400, temperature=0,
                                               response_format={"type": "json_object"})
    choice = r.choices[0]
    if choice.finish_reason == "stop":  # a random model may write one string until max_tokens
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls(server, tool_choice):
    r = client(server).chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice=tool_choice,
                                               max_tokens=300, temperature=1.0, seed=3, n=4,
                                               parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function"
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_streamed_tool_call_arguments(server):
    stream = client(server).chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS,
                                                    tool_choice="required", max_tokens=300, temperature=1.0,
                                                    seed=11, stream=True)
    calls: dict[int, dict] = {}
    pieces = 0
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            if d.id is not None:  # the first piece of a call: id, type and name, as OpenAI sends it
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
                pieces += 1
    assert finish == "tool_calls" and calls and pieces > 1
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tool_choice_none_and_auto_are_not_forced(server):
    c = client(server)
    for choice in ("none", "auto"):
        r = c.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=5,
                                      temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
        if choice == "none":
            assert not r.choices[0].message.tool_calls


@pytest.mark.parametrize("field,param", [
    ("tools", "tools[1].function.parameters"),
    ("response_format", "response_format.json_schema.schema"),
])
def test_invalid_schemas_are_400_naming_the_parameter(server, field, param):
    bad = {"type": "object", "properties": {"x": {"type": "integr"}}}
    kw = {"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": bad}}]} \
        if field == "tools" else {"response_format": {"type": "json_schema", "json_schema": {"name": "w",
                                                                                             "schema": bad}}}
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=5, **kw)
    assert e.value.body["param"] == param and "integr" in e.value.body["message"]


def test_schema_the_grammar_library_cannot_compile_is_400(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "string", "format": "no-such"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=5, response_format=fmt)
    assert e.value.body["param"] == "response_format"


def test_body_over_the_limit_is_413_naming_it(model, tokenizer):
    engine = make_engine(model, tokenizer)
    try:
        with serve(engine, tokenizer, max_request_bytes=10_000) as s:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x" * 20_000}]}
            r = httpx.post(s.base_url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 413 and "10000 bytes" in r.json()["error"]["message"]
            r = httpx.post(s.base_url + "/v1/completions", json={"prompt": "x" * 20_000}, timeout=30)
            assert r.status_code == 413
    finally:
        engine.shutdown()


def test_health_answers_while_a_huge_request_is_prepared(server):
    """A 10 MB chat is read, parsed and checked in the worker pool (it cannot fit the context whatever it tokenizes
    to: a 400 before tokenizing): `/health` stays under 100 ms meanwhile."""
    text = ("the cat sat on the mat. " * 8)[:190] + "\n"
    body = {"model": MODEL_NAME, "max_tokens": 1,
            "messages": [{"role": "user", "content": text * (10 * 2**20 // len(text))}]}
    raw = json.dumps(body).encode()
    assert len(raw) > 10 * 2**20
    result = {}

    def big():
        t0 = time.monotonic()
        r = httpx.post(server + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=120)
        result["status"], result["seconds"] = r.status_code, time.monotonic() - t0

    thread = threading.Thread(target=big)
    thread.start()
    latencies = []
    with httpx.Client(base_url=server, timeout=10) as h:
        while thread.is_alive():
            t0 = time.monotonic()
            assert h.get("/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)
    thread.join()
    assert result["status"] == 400
    assert latencies, result
    assert max(latencies) < 0.1, (max(latencies), result)


def test_never_admissible_is_400_not_503(model, tokenizer):
    engine = make_engine(model, tokenizer, short_budget_tokens=1500)
    try:
        with serve(engine, tokenizer) as s:
            c = client(s.base_url)
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=300, n=8)
            assert e.value.body["param"] == "n" and "1500" in e.value.body["message"]
            with pytest.raises(openai.BadRequestError):
                c.completions.create(model=MODEL_NAME, prompt=["a", "b", "c"], max_tokens=600)
            r = c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=3, n=2)
            assert len(r.choices) == 2
    finally:
        engine.shutdown()
