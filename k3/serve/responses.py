"""`POST /v1/responses` (OpenAI's Responses API) and `GET /v1/responses/{id}`, over the chat path.

A Responses request maps onto one chat request (`chat_body`): `instructions` → a system message, `input` (a
string, or message / `function_call` / `function_call_output` / `reasoning` items) → messages, `tools` (flat
function tools) → chat tools, `text.format` → `response_format`, `reasoning.effort` → `reasoning_effort`,
`max_output_tokens` → `max_completion_tokens`. It is then prepared, constrained and run exactly as a chat
completion (`handlers.prepare_chat_request`, `ChatChoice`), and the parsed reply becomes output items: a
`reasoning` item (the think channel, as `reasoning_text` content), a `message` with one `output_text` part,
and one `function_call` item per call. Streams send the typed events (`response.created`,
`response.output_item.added`, `response.output_text.delta`, `response.function_call_arguments.delta`, …,
`response.completed`), each with a `sequence_number`.

State lives for the request only, unless `store: true`: then the response and its conversation go into a
bounded LRU (`AppState.stored`, `STORED_RESPONSES`), which `previous_response_id` continues and
`GET /v1/responses/{id}` reads.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from k3.chat.template import ReplyStream
from k3.serve import protocol as P
from k3.serve.errors import APIError, bad_request
from k3.serve.handlers import ChatChoice, _state, prepare_chat_request
from k3.serve.state import AppState
from k3.serve.stream import PING, EventStreamResponse, Run, until_done
from k3.serve.validate import authorize, param_path, parse_body, read_raw


def _content(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A message's Responses content as chat content: text parts joined into one string, or, when it holds images
    (`input_image` with an `image_url`: a data URL, or a local file behind --allow-local-images), chat parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text", "text"):
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "input_image":
                if not isinstance(part.get("image_url"), str):
                    raise bad_request("an input_image needs an image_url (file_id is not supported)",
                                      f"{param}[{j}].image_url")
                parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
            else:
                raise bad_request("only text and image content parts are supported", f"{param}[{j}]")
        if all(p["type"] == "text" for p in parts):
            return "\n".join(p["text"] for p in parts)
        return parts
    raise bad_request("content must be a string or a list of text and image parts", param)


def chat_body(req: P.ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request a Responses request stands for (`history`: the stored conversation it continues)."""
    messages = list(history)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    reasoning = None
    for i, item in enumerate(items):
        kind, param = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            message = {"role": role, "content": _content(item.get("content"), f"{param}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "reasoning":
            reasoning = "".join(p.get("text", "") for p in (item.get("content") or item.get("summary") or []))
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or last.get("content"):
                last = {"role": "assistant", "content": None, "tool_calls": []}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise bad_request(f"input items of type {kind!r} are not supported", f"{param}.type")
    body: dict[str, Any] = {"messages": messages, "parallel_tool_calls": req.parallel_tool_calls,
                            "stream": req.stream}
    if req.model is not None:
        body["model"] = req.model
    for key, value in (("max_completion_tokens", req.max_output_tokens), ("temperature", req.temperature),
                       ("top_p", req.top_p), ("seed", req.seed)):
        if value is not None:
            body[key] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                              "strict") if k in t}}
                         for t in req.tools]
    if isinstance(req.tool_choice, dict):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.get("name")}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = (req.text or {}).get("format")
    if fmt and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif fmt:
        body["response_format"] = {"type": fmt.get("type")}
    if req.reasoning and req.reasoning.get("effort") is not None:
        body["reasoning_effort"] = req.reasoning["effort"]
    return body


def prepare(state: AppState, raw: bytes):
    """Body → (Responses request, chat request, its raw dict, prompt, thinking, params); in the worker pool."""
    req, _ = parse_body(raw, P.ResponsesRequest)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = state.stored.get(req.previous_response_id)
        if stored is None:
            raise bad_request(f"no stored response {req.previous_response_id!r} (responses are kept only with "
                              "store: true, and only the most recent ones)", "previous_response_id")
        history = stored["messages"]
    body = chat_body(req, history)
    try:
        chat = P.ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        raise bad_request(f"{param_path(err['loc']) or 'input'}: {err['msg']}", param_path(err["loc"])) from None
    chat, prompt, thinking, params = prepare_chat_request(state, chat, body)
    return req, chat, body, prompt, thinking, params


class Output:
    """Turns a chat choice's streamed deltas into Responses output items and their events."""

    def __init__(self, response_id: str):
        self.response_id = response_id
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.items.append(item)
        self.open = item
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        k, where = len(self.items) - 1, {"item_id": item["id"], "output_index": len(self.items) - 1}
        item["status"] = "completed"
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", **where, content_index=0, text=part["text"]))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
        else:
            events.append(self.event("response.function_call_arguments.done", **where,
                                     arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=k, item=item))
        return events

    def feed(self, delta: P.ChatDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning_content:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._start({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                                       "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
            self.open["content"][0]["text"] += delta.reasoning_content
            events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                     output_index=len(self.items) - 1, content_index=0,
                                     delta=delta.reasoning_content))
        if delta.content:
            if self.open is None or self.open["type"] != "message":
                events += self._start({"type": "message", "id": "msg_" + uuid.uuid4().hex, "role": "assistant",
                                       "status": "in_progress",
                                       "content": [{"type": "output_text", "text": "", "annotations": []}]})
            self.open["content"][0]["text"] += delta.content
            events.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                     output_index=len(self.items) - 1, content_index=0, delta=delta.content))
        for call in delta.tool_calls or []:
            if call.id is not None:
                events += self._start({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call.id,
                                       "name": call.function.name or "", "arguments": "", "status": "in_progress"})
            if call.function.arguments and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += call.function.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                         output_index=len(self.items) - 1, delta=call.function.arguments))
        return events


def _response(state: AppState, req: P.ResponsesRequest, response_id: str, created: int, output: Output,
              choice: ChatChoice | None, prompt_len: int, status: str) -> dict[str, Any]:
    usage = None
    incomplete = None
    if choice is not None:
        reasoning = choice.reply.parser.reasoning_tokens
        usage = {"input_tokens": prompt_len, "input_tokens_details": {"cached_tokens": choice.cached_tokens},
                 "output_tokens": choice.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": reasoning},
                 "total_tokens": prompt_len + choice.completion_tokens}
        if choice.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "model": state.model_name,
            "output": output.items, "usage": usage, "error": None, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning, "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "metadata": req.metadata or {}}


def _store(state: AppState, body: dict[str, Any], choice: ChatChoice, response: dict[str, Any]) -> None:
    reply = choice.acc.reply(False)
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning_content:
        message["reasoning_content"] = reply.reasoning_content
    if reply.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                               "arguments": c.arguments}}
                                 for c in reply.tool_calls]
    state.store_response(response["id"], {"messages": body["messages"] + [message], "response": response})


async def create_response(request: Request):
    state = _state(request)
    authorize(state, request)
    raw = await read_raw(request, state.max_request_bytes)
    req, chat, body, prompt, thinking, params = await state.offload(prepare, state, raw)
    response_id, created = "resp_" + uuid.uuid4().hex, int(time.time())
    run = Run(state.engine, [(f"{response_id}-0", prompt, params[0])])
    tools_on = bool(chat.tools) and chat.tool_choice != "none"
    choice = ChatChoice(0, run, ReplyStream(state.tokenizer, thinking, ()), thinking, tools_on,
                        chat.parallel_tool_calls, False, state.token_text)
    output = Output(response_id)
    run.start()
    if not req.stream:
        async def consume() -> None:
            async for _, out in run.events():
                piece = choice.update(out)
                if piece is not None:
                    output.feed(piece.delta)
            output.close()

        await until_done(request, run, consume)
        response = _response(state, req, response_id, created, output, choice, len(prompt), "completed")
        if req.store:
            _store(state, body, choice, response)
        return response

    await run.admitted(state.admission_wait)

    def sse(event: dict[str, Any]) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def events() -> AsyncIterator[str]:
        try:
            start = _response(state, req, response_id, created, output, None, len(prompt), "in_progress")
            yield sse(output.event("response.created", response=start))
            yield sse(output.event("response.in_progress", response=start))
            async for event in run.events(state.ping_seconds):
                if event is PING:
                    yield ": ping\n\n"
                    continue
                piece = choice.update(event[1])
                for e in output.feed(piece.delta) if piece is not None else []:
                    yield sse(e)
            for e in output.close():
                yield sse(e)
            response = _response(state, req, response_id, created, output, choice, len(prompt), "completed")
            if req.store:
                _store(state, body, choice, response)
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield sse(output.event(kind, response=response))
        except APIError as e:
            yield sse(output.event("error", code=e.code, message=e.message, param=e.param))
        finally:
            run.close()

    return EventStreamResponse(events(), run.close)


async def get_response(response_id: str, request: Request):
    state = _state(request)
    authorize(state, request)
    stored = state.stored.get(response_id)
    if stored is None:
        raise APIError(404, f"no stored response {response_id!r}", "not_found_error", "response_id")
    return stored["response"]
