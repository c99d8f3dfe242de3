"""Bad input is a 4xx with an OpenAI error body naming the field, never a 5xx or a crash (docs/serving.md)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import MODEL_NAME

OK = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"model": MODEL_NAME, "messages": OK, "max_tokens": 2, **fields}


# (body: dict, or raw bytes / str; expected status; expected `param`, or None for "any")
CHAT_CASES = [
    (b"{not json", 400, None),
    (b"", 400, None),
    (b"[]", 400, None),
    (b'"hello"', 400, None),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),  # invalid UTF-8
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages[0].content"),  # lone surrogate
    (b"[" * 100_000, 400, None),  # nested too deeply for the JSON parser
    ('{"messages": [{"role": "user", "content": "x"}], "user": ' + "[" * 200 + "]" * 200 + "}", 400, None),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": json.loads('{"a":' * 900 + "1"
                                                                                         + "}" * 900)}}]), 400, None),
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [None]}, 400, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400,
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400, None),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "nope"}]}, 400, "messages[0].tool_call_id"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]"),
    (chat(temperature="hot"), 400, "temperature"),
    (chat(temperature=-1), 400, "temperature"),
    (chat(temperature=3), 400, "temperature"),
    ('{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "temperature"),
    (chat(top_p=1.5), 400, "top_p"),
    (chat(n=0), 400, "n"),
    (chat(n=10_000), 400, "n"),
    (chat(n="2"), 400, "n"),
    (chat(n=2.5), 400, "n"),
    (chat(max_tokens=0), 400, "max_tokens"),
    (chat(max_tokens=-5), 400, "max_tokens"),
    (chat(max_tokens=True), 400, "max_tokens"),
    (chat(max_tokens=1e30), 400, "max_tokens"),
    (chat(max_tokens=10**12), 400, "max_tokens"),  # absurd: over the context
    (chat(max_tokens=10**40), 400, "max_tokens"),
    (chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (chat(max_completion_tokens=10**9), 400, "max_completion_tokens"),
    (chat(stop=5), 400, "stop"),
    (chat(stop=[""]), 400, "stop[0]"),
    (chat(stop=["a"] * 100), 400, "stop"),
    (chat(seed="x"), 400, "seed"),
    (chat(seed=2**70), 400, "seed"),
    (chat(presence_penalty=3), 400, "presence_penalty"),
    (chat(frequency_penalty=-3), 400, "frequency_penalty"),
    (chat(logprobs="yes"), 400, "logprobs"),
    (chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    (chat(top_logprobs=2), 400, "top_logprobs"),
    (chat(stream="yes"), 400, "stream"),
    (chat(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
    (chat(tools=[{"type": "function"}]), 400, "tools[0].function"),
    (chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400, "tools[0].function.name"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"), 400, "tool_choice"),
    (chat(tool_choice="required"), 400, "tool_choice"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    (chat(response_format={"type": "xml"}), 400, "response_format.type"),
    (chat(reasoning_effort="extreme"), 400, "reasoning_effort"),
    (chat(logit_bias={"5": 10}), 400, "logit_bias"),
    (chat(logit_bias={"5": 1000}), 400, "logit_bias.5"),
    (chat(model=5), 400, "model"),
    (chat(model="gpt-4o"), 404, "model"),
    (chat(messages=[{"role": "user", "content": "x" * 5000}]), 400, "messages"),  # prompt over the context
]

COMPLETION_CASES = [
    ({"max_tokens": 2}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": [10**6]}, 400, "prompt"),
    ({"prompt": [[1], [10**6]]}, 400, "prompt[1]"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "x", "echo": "x"}, 400, "echo"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": "x", "model": "davinci"}, 404, "model"),
]


@pytest.fixture(scope="module")
def http(live):
    _, url = live
    with httpx.Client(base_url=url, timeout=30) as c:
        yield c


def _post(http, path, body):
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    return http.post(path, content=body, headers={"content-type": "application/json"})


def _check(r, status, param):
    assert r.status_code == status, r.text
    assert r.headers["x-request-id"]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if status == 400:
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,status,param", CHAT_CASES, ids=[str(i) for i in range(len(CHAT_CASES))])
def test_chat_bad_input(http, body, status, param):
    _check(_post(http, "/v1/chat/completions", body), status, param)


@pytest.mark.parametrize("body,status,param", COMPLETION_CASES, ids=[str(i) for i in range(len(COMPLETION_CASES))])
def test_completions_bad_input(http, body, status, param):
    _check(_post(http, "/v1/completions", {"model": MODEL_NAME, **body}), status, param)


def test_context_length_exceeded_code(http):
    r = _post(http, "/v1/chat/completions", chat(max_tokens=10**12))
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_routes_and_methods(http):
    _check(http.get("/v1/chat/completions"), 405, None)
    _check(http.post("/v1/nothing", json={}), 404, None)


def test_server_is_fine_afterwards(http):
    r = http.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    assert "k3_requests_running 0" in http.get("/metrics").text
