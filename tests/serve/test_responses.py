"""`/v1/responses` through the official client's `responses.create` (k3/serve/responses.py): text, reasoning
items (scripted on the fake engine: a random model rarely closes its think channel), forced function calls
(the real engine, constrained), streaming events, `store` and `previous_response_id`."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from k3.chat.template import ChatTemplate
from tests.serve.conftest import MODEL_NAME, make_engine, serve

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER,
          "strict": True}]


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def live_url(model, tokenizer):
    engine = make_engine(model, tokenizer)
    try:
        with serve(engine, tokenizer) as s:
            yield s.base_url
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()


def test_text_response_and_usage(live_url, tokenizer):
    r = client(live_url).responses.create(model=MODEL_NAME, input="Hello there", instructions="Be brief.",
                                          max_output_tokens=6, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL_NAME
    assert r.status in ("completed", "incomplete")
    prompt = ChatTemplate(tokenizer).render([{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hello there"}])
    assert r.usage.input_tokens == len(prompt) and 1 <= r.usage.output_tokens <= 6
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert isinstance(r.output_text, str)


def test_forced_function_call_validates(live_url):
    r = client(live_url).responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=TOOLS,
                                          tool_choice="required", max_output_tokens=200, temperature=1.0,
                                          extra_body={"seed": 2})
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) >= 1
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_streamed_events(live_url):
    stream = client(live_url).responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=TOOLS,
                                               tool_choice={"type": "function", "name": "get_weather"},
                                               max_output_tokens=200, temperature=1.0, extra_body={"seed": 4},
                                               stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.output_item.added" in kinds and "response.function_call_arguments.done" in kinds
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = events[-1].response
    call = next(item for item in final.output if item.type == "function_call")
    assert args == call.arguments
    jsonschema.validate(json.loads(args), WEATHER)


def test_json_schema_text_format(live_url):
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}
    r = client(live_url).responses.create(model=MODEL_NAME, input="Weather?", text=fmt, max_output_tokens=200,
                                          temperature=1.0, extra_body={"seed": 1})
    jsonschema.validate(json.loads(r.output_text), WEATHER)


def test_store_and_previous_response_id(live_url, tokenizer):
    c = client(live_url)
    first = c.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=3, temperature=0, store=True)
    assert c.responses.retrieve(first.id).id == first.id
    second = c.responses.create(model=MODEL_NAME, input="And again?", previous_response_id=first.id,
                                max_output_tokens=3, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 1
    unstored = c.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, temperature=0)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL_NAME, input="x", previous_response_id=unstored.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_reasoning_item_and_text(fake, tokenizer):
    engine, url = fake
    template = ChatTemplate(tokenizer)
    head = template.open_tag("think")
    message = {"role": "assistant", "reasoning_content": "let me see", "content": "Sunny."}
    engine.script.append(template.assistant_body(message, thinking=True)[len(head):] + [template.end_id])
    r = client(url).responses.create(model=MODEL_NAME, input="Weather?", reasoning={"effort": "high"})
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == "let me see" and r.output_text == "Sunny."
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    engine.script.append(template.assistant_body(message, thinking=True)[len(head):] + [template.end_id])
    events = list(client(url).responses.create(model=MODEL_NAME, input="Weather?", reasoning={"effort": "high"},
                                               stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (text, thought) == ("Sunny.", "let me see")
