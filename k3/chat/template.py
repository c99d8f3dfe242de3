"""K3's chat format (XTML) as token ids: render a conversation into a prompt, parse the model's reply.

XTML (docs/architecture.md §9.5, docs/serving.md, K3 report App. F) writes markup with three reserved special
tokens instead of angle brackets: `<|open|>NAME attrs<|sep|> … <|close|>NAME<|sep|>`; every message ends
with `<|end_of_msg|>`, the generation stop token. A rendered prompt, top to bottom:

    [BOS]
    <|open|>option name="tool-declare"<|sep|>[{"type":"function",…}]<|end_of_msg|>      global options
    <|open|>option name="thinking-effort"<|sep|>high<|end_of_msg|>
    <|open|>message role="system"<|sep|>You are …<|end_of_msg|>                          the history
    <|open|>message role="user"<|sep|>Weather in Paris?<|end_of_msg|>
    <|open|>message role="assistant"<|sep|>
        <|open|>think<|sep|>…<|close|>think<|sep|>
        <|open|>response<|sep|>…<|close|>response<|sep|>                                   (always, maybe empty)
        <|open|>tools<|sep|><|open|>call tool="get_weather" index="0"<|sep|>
            <|open|>argument name="city"<|sep|>Paris<|close|>argument<|sep|>
            <|open|>argument name="days" type="json"<|sep|>3<|close|>argument<|sep|>
        <|close|>call<|sep|><|close|>tools<|sep|><|end_of_msg|>
    <|open|>message role="tool" tool="get_weather" index="0"<|sep|>{"temp": 21}<|end_of_msg|>
    <|open|>option name="tool-choice"<|sep|>required<|end_of_msg|>                       one-shot options
    <|open|>option name="response-format"<|sep|>{"type":"json_object"}<|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>                          generation prompt

Design rules (each one is a test):
- Structural tokens are inserted by id; every piece of user-controlled text goes through
  `Tokenizer.encode`, which never produces a special id, so text spelling `<|open|>` stays text.
- Rendering is a pure function of its inputs. Options that hold for the whole conversation (tool
  declarations, the thinking effort) come before the history; options of one request (`tool_choice`,
  `response_format`) come after it. Appending a turn, or changing a one-shot option, therefore keeps the
  history's token prefix, which the engine's prefix cache then serves (docs/inference.md).
- Thinking mode (a `reasoning_effort` is set) renders every historical think channel, even an empty one
  (preserved thinking), and every assistant message has a response channel, even an empty one before tool
  calls, so the model's own reply, rendered back as history, continues the cached prefix token for token.
- Tool calls carry `tool` and `index`; a tool result repeats the pair. String arguments are raw text, other
  JSON values compact JSON (`type="json"`); arguments that are not a JSON object fall back to one
  `<|open|>json<|sep|>…<|close|>json<|sep|>` block (input only; the parser reads it too).
- `render_spans` is `render` cut into spans that say who writes each token: the model writes an assistant
  turn after its generation prompt (its channels, tool calls and `<|end_of_msg|>`), everything else is
  input. Supervised fine-tuning builds its loss mask from these spans (docs/post-training.md), so training
  sees exactly the tokens the server renders.
- The reply parser is a token-level state machine fed incrementally (`OutputParser`), so streaming and
  non-streaming share one code path: think → `reasoning_content`, response → `content`, calls → OpenAI
  `tool_calls` whose arguments stream as pieces of one JSON object string. `ReplyStream` adds stop strings
  on the content (the detokenizer and stop matching live in `k3/chat/detokenize.py`).
"""

from __future__ import annotations

import html
import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from k3.chat.detokenize import IncrementalDecoder, StopMatcher
from k3.tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
# The trained effort levels (K3 report §4.1); `medium` exists only in the schema and maps by config.
EFFORT_LEVELS = ("low", "high", "max")
_EFFORT_ALIASES = {"minimal": "low", "xhigh": "max"}
_HEADER = re.compile(r'\s*([A-Za-z_][\w.-]*)((?:\s+[\w.-]+="[^"]*")*)\s*$')
_ATTR = re.compile(r'([\w.-]+)="([^"]*)"')


class TemplateError(ValueError):
    """A conversation the template cannot render; `param` names the offending request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def normalize_effort(effort: str | None, medium: str = "high") -> str | None:
    """An API `reasoning_effort` → a trained level (low/high/max), or None for instruct mode (no thinking)."""
    if effort is None or effort == "none":
        return None
    effort = _EFFORT_ALIASES.get(effort, effort)
    if effort == "medium":
        effort = medium
    if effort not in EFFORT_LEVELS:
        raise TemplateError(f"reasoning_effort must be one of none, low, medium, high, max; got {effort!r}",
                            "reasoning_effort")
    return effort


def compact_json(value: Any) -> str:
    """Deterministic JSON: key order kept, no spaces, non-ASCII as is (docs/serving.md)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def content_text(content: Any, param: str) -> str:
    """OpenAI message content (a string, a list of text parts, or None) → one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise TemplateError(f"content part of type {kind!r} is not supported (text only)",
                                    f"{param}[{j}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise TemplateError("content must be a string or a list of text parts", param)


def header_attrs(attrs: Mapping[str, Any]) -> str:
    return "".join(f' {k}="{html.escape(str(v), quote=True)}"' for k, v in attrs.items())


@dataclass
class Span:
    """Consecutive rendered tokens of one part of a conversation (`ChatTemplate.render_spans`).

    `role`: "bos", "option", "generation-prompt", or the role of the message the tokens belong to.
    `written`: the model writes these tokens itself: an assistant turn after its generation prompt (think and
    response channels, tool calls, the closing `<|end_of_msg|>`), except a raw-JSON arguments block (input only).
    """

    role: str
    ids: list[int]
    written: bool = False


def _add_span(spans: list[Span], role: str, ids: list[int], written: bool = False) -> None:
    """Append `ids`, merged into the last span when it has the same role and writer."""
    if not ids:
        return
    if spans and spans[-1].role == role and spans[-1].written == written:
        spans[-1].ids.extend(ids)
    else:
        spans.append(Span(role, list(ids), written))


def _join(spans: Iterable[Span]) -> list[int]:
    return [t for span in spans for t in span.ids]


@dataclass
class ChatTemplate:
    """Renders OpenAI-shaped conversations (plain dicts) into K3 token ids. See the module docstring."""

    tokenizer: Tokenizer
    medium_effort: str = "high"  # `reasoning_effort: medium` → this trained level
    add_bos: bool = True

    def __post_init__(self) -> None:
        tok = self.tokenizer
        self.open_id = tok.special_id("<|open|>")
        self.close_id = tok.special_id("<|close|>")
        self.sep_id = tok.special_id("<|sep|>")
        self.end_id = tok.eos_id
        self._encode_header = lru_cache(maxsize=4096)(lambda text: tuple(tok.encode(text)))

    def open_tag(self, tag: str, /, **attrs: Any) -> list[int]:
        return [self.open_id, *self._encode_header(tag + header_attrs(attrs)), self.sep_id]

    def close_tag(self, tag: str) -> list[int]:
        return [self.close_id, *self._encode_header(tag), self.sep_id]

    def text(self, s: str) -> list[int]:
        return self.tokenizer.encode(s) if s else []

    def option(self, name: str, body: str) -> list[int]:
        return self.open_tag("option", name=name) + self.text(body) + [self.end_id]

    def generation_prompt(self, thinking: bool) -> list[int]:
        """`<|open|>message role="assistant"<|sep|>` + the think (thinking) or response (instruct) channel."""
        return self.open_tag("message", role="assistant") + self.open_tag("think" if thinking else "response")

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               reasoning_effort: str | None = None, tool_choice: Any = None,
               response_format: Mapping[str, Any] | None = None, add_generation_prompt: bool = True) -> list[int]:
        """OpenAI `messages` (+ request options) → prompt token ids. Raises `TemplateError` on bad input.

        `tools` and `response_format` are rendered as given (pass the client's own JSON objects so key
        order is theirs); `tool_choice` is "none" | "auto" | "required" | {"type": "function", ...}.
        """
        return _join(self.render_spans(messages, tools=tools, reasoning_effort=reasoning_effort,
                                       tool_choice=tool_choice, response_format=response_format,
                                       add_generation_prompt=add_generation_prompt))

    def render_spans(self, messages: Sequence[Mapping[str, Any]], *,
                     tools: Sequence[Mapping[str, Any]] | None = None, reasoning_effort: str | None = None,
                     tool_choice: Any = None, response_format: Mapping[str, Any] | None = None,
                     add_generation_prompt: bool = True) -> list[Span]:
        """`render`'s tokens as `Span`s, in order: joined, they are exactly `render(...)` with the same arguments."""
        if not messages:
            raise TemplateError("messages must hold at least one message", "messages")
        effort = normalize_effort(reasoning_effort, self.medium_effort)
        thinking = effort is not None
        spans: list[Span] = []
        if self.add_bos:
            _add_span(spans, "bos", [self.tokenizer.bos_id])
        if tools:
            _add_span(spans, "option", self.option("tool-declare", compact_json(list(tools))))
        if thinking:
            _add_span(spans, "option", self.option("thinking-effort", effort))
        calls: dict[str, tuple[str, int]] = {}  # tool_call_id → (tool name, index) of the latest assistant turn
        for i, message in enumerate(messages):
            for span in self.message_spans(message, thinking=thinking, calls=calls, param=f"messages[{i}]"):
                _add_span(spans, span.role, span.ids, span.written)
        if tool_choice is not None and tool_choice != "auto" and tools:
            body = tool_choice if isinstance(tool_choice, str) else compact_json(tool_choice)
            _add_span(spans, "option", self.option("tool-choice", body))
        if response_format is not None and response_format.get("type", "text") != "text":
            _add_span(spans, "option", self.option("response-format", compact_json(dict(response_format))))
        if add_generation_prompt:
            _add_span(spans, "generation-prompt", self.generation_prompt(thinking))
        return spans

    def render_message(self, message: Mapping[str, Any], *, thinking: bool,
                       calls: dict[str, tuple[str, int]] | None = None, param: str = "messages[0]") -> list[int]:
        """One message, `<|open|>message role=…<|sep|>` … `<|end_of_msg|>`."""
        return _join(self.message_spans(message, thinking=thinking, calls=calls, param=param))

    def message_spans(self, message: Mapping[str, Any], *, thinking: bool,
                      calls: dict[str, tuple[str, int]] | None = None, param: str = "messages[0]") -> list[Span]:
        """`render_message` as `Span`s."""
        calls = {} if calls is None else calls
        role = message.get("role")
        if role not in ROLES:
            raise TemplateError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}", f"{param}.role")
        if role == "assistant":
            return self.assistant_message_spans(message, thinking=thinking, calls=calls, param=param)
        text = content_text(message.get("content"), f"{param}.content")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in calls:
                raise TemplateError(f"tool message answers unknown tool_call_id {call_id!r}: it must follow an "
                                    "assistant message with that tool call", f"{param}.tool_call_id")
            name, index = calls[call_id]
            header = self.open_tag("message", role="tool", tool=name, index=index)
            return [Span(role, header + self.text(text) + [self.end_id])]
        attrs = {"role": role}
        if message.get("name"):
            attrs["name"] = message["name"]
        return [Span(role, self.open_tag("message", **attrs) + self.text(text) + [self.end_id])]

    def render_assistant(self, message: Mapping[str, Any], *, thinking: bool,
                         calls: dict[str, tuple[str, int]] | None = None, param: str = "messages[0]") -> list[int]:
        return _join(self.assistant_message_spans(message, thinking=thinking, calls=calls, param=param))

    def assistant_message_spans(self, message: Mapping[str, Any], *, thinking: bool,
                                calls: dict[str, tuple[str, int]] | None = None,
                                param: str = "messages[0]") -> list[Span]:
        """`render_assistant` as `Span`s: the generation prompt, then what the model writes."""
        spans = [Span("assistant", self.open_tag("message", role="assistant"))]
        for span in self.assistant_spans(message, thinking=thinking, calls=calls, param=param):
            _add_span(spans, span.role, span.ids, span.written)
        _add_span(spans, "assistant", [self.end_id], written=True)
        return spans

    def assistant_body(self, message: Mapping[str, Any], *, thinking: bool,
                       calls: dict[str, tuple[str, int]] | None = None, param: str = "messages[0]") -> list[int]:
        """The channels of an assistant message (what the model writes after the generation prompt's tag)."""
        return _join(self.assistant_spans(message, thinking=thinking, calls=calls, param=param))

    def assistant_spans(self, message: Mapping[str, Any], *, thinking: bool,
                        calls: dict[str, tuple[str, int]] | None = None, param: str = "messages[0]") -> list[Span]:
        """`assistant_body` as `Span`s: the first channel's opening tag (part of the generation prompt) is not
        written by the model, nor is a raw-JSON arguments block; everything else is."""
        calls = {} if calls is None else calls
        reasoning = message.get("reasoning_content") or ""
        if not isinstance(reasoning, str):
            raise TemplateError("reasoning_content must be a string", f"{param}.reasoning_content")
        content = content_text(message.get("content"), f"{param}.content")
        tool_calls = message.get("tool_calls") or []
        spans: list[Span] = []
        if thinking or reasoning:
            _add_span(spans, "assistant", self.open_tag("think"))
            _add_span(spans, "assistant", self.text(reasoning) + self.close_tag("think"), written=True)
            # always a response channel (maybe empty), so a reply written after the instruct prompt renders back as is
            _add_span(spans, "assistant", self.open_tag("response"), written=True)
        else:
            _add_span(spans, "assistant", self.open_tag("response"))
        _add_span(spans, "assistant", self.text(content) + self.close_tag("response"), written=True)
        if tool_calls:
            calls.clear()
            _add_span(spans, "assistant", self.open_tag("tools"), written=True)
            for index, call in enumerate(tool_calls):
                cparam = f"{param}.tool_calls[{index}]"
                function = call.get("function") or {}
                name = function.get("name")
                if not isinstance(name, str) or not name:
                    raise TemplateError("a tool call needs function.name", f"{cparam}.function.name")
                calls[call.get("id") or f"call_{index}"] = (name, index)
                _add_span(spans, "assistant", self.open_tag("call", tool=name, index=index), written=True)
                for span in self.argument_spans(function.get("arguments", "{}"), f"{cparam}.function.arguments"):
                    _add_span(spans, span.role, span.ids, span.written)
                _add_span(spans, "assistant", self.close_tag("call"), written=True)
            _add_span(spans, "assistant", self.close_tag("tools"), written=True)
        return spans

    def arguments(self, arguments: Any, param: str) -> list[int]:
        """A JSON-object argument string → typed `argument` blocks; anything else → one `json` block."""
        return _join(self.argument_spans(arguments, param))

    def argument_spans(self, arguments: Any, param: str) -> list[Span]:
        """`arguments` as one `Span`: typed blocks are written by the model, a raw `json` block is input only."""
        if not isinstance(arguments, str):
            raise TemplateError("function.arguments must be a JSON string", param)
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            return [Span("assistant", self.open_tag("json") + self.text(arguments) + self.close_tag("json"))]
        ids = []
        for key, value in parsed.items():
            if isinstance(value, str):
                ids += self.open_tag("argument", name=key) + self.text(value)
            else:
                ids += self.open_tag("argument", name=key, type="json") + self.text(compact_json(value))
            ids += self.close_tag("argument")
        return [Span("assistant", ids, written=True)]


@dataclass
class ToolCallDelta:
    """A piece of tool call `index`: the first piece carries `id` and `name`, later ones only `arguments`."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ReplyDelta:
    """What one `OutputParser.feed` added."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: ReplyDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        for piece in other.tool_calls:
            self.add_call(piece)

    def add_call(self, piece: ToolCallDelta) -> None:
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == piece.index and piece.id is None:
            last.arguments += piece.arguments
        else:
            self.tool_calls.append(ToolCallDelta(piece.index, piece.arguments, piece.id, piece.name))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as a string, as OpenAI returns it


@dataclass
class Reply:
    """A parsed assistant reply. `content` is None when the reply holds only tool calls."""

    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall]


@dataclass
class _Frame:
    kind: str  # message | think | response | tools | call | argument | json | other
    call: int = -1  # the tool call index this frame belongs to (call, argument, json)
    string_arg: bool = False
    wrote_args: bool = False  # call: an argument or json block has written into the arguments string
    json_body: bool = False  # call: its arguments came as one raw `json` block


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class OutputParser:
    """Incremental parser of the tokens the model writes after `ChatTemplate.generation_prompt`.

    `feed(ids)` returns a `ReplyDelta`; `finish()` flushes the rest. Specials are recognised by id, never by
    text. The parser is lenient: an unknown tag's content is dropped, a mismatched close tag closes up to
    its match, and open tool calls are closed at the end so their arguments stay one JSON object.
    """

    def __init__(self, tokenizer: Tokenizer, thinking: bool, call_id=new_call_id):
        tok = tokenizer
        self.tokenizer = tok
        self._open = tok.special_id("<|open|>")
        self._close = tok.special_id("<|close|>")
        self._sep = tok.special_id("<|sep|>")
        self._ends = set(tok.stop_ids)
        self._call_id = call_id
        self._stack = [_Frame("message"), _Frame("think" if thinking else "response")]
        self._header: list[int] | None = None  # ids of a tag being read, after <|open|> / <|close|>
        self._header_is_close = False
        self._decoder = IncrementalDecoder(tok)
        self.num_calls = 0
        self.reasoning_tokens = 0
        self.done = False

    def feed(self, token_ids: Iterable[int]) -> ReplyDelta:
        delta = ReplyDelta()
        for t in token_ids:
            if self.done:
                break
            t = int(t)
            if any(f.kind == "think" for f in self._stack):
                self.reasoning_tokens += 1
            if t in self._ends:
                self._finish_into(delta)
            elif t in (self._open, self._close):
                self._flush_text(delta)
                self._header, self._header_is_close = [], t == self._close
            elif t == self._sep:
                if self._header is not None:
                    header = self.tokenizer.decode(self._header)
                    is_close, self._header = self._header_is_close, None
                    (self._close_tag if is_close else self._open_tag)(header, delta)
            elif self._header is not None:
                self._header.append(t)
            elif self.tokenizer.is_special(t):
                continue
            else:
                self._route(self._decoder.feed([t]), delta)
        return delta

    def finish(self) -> ReplyDelta:
        delta = ReplyDelta()
        if not self.done:
            self._finish_into(delta)
        return delta

    def _finish_into(self, delta: ReplyDelta) -> None:
        self._flush_text(delta)
        while len(self._stack) > 1:
            self._pop(delta)
        self._header = None
        self.done = True

    def _flush_text(self, delta: ReplyDelta) -> None:
        self._route(self._decoder.flush(), delta)

    def _route(self, text: str, delta: ReplyDelta) -> None:
        if not text:
            return
        top = self._stack[-1]
        if top.kind == "think":
            delta.reasoning += text
        elif top.kind == "response" or (top.kind == "message" and text.strip()):
            delta.content += text
        elif top.kind == "argument":
            # a string argument streams as the inside of a JSON string literal
            piece = json.dumps(text, ensure_ascii=False)[1:-1] if top.string_arg else text
            delta.add_call(ToolCallDelta(top.call, piece))
        elif top.kind == "json":
            delta.add_call(ToolCallDelta(top.call, text))

    def _current_call(self) -> _Frame | None:
        return next((f for f in reversed(self._stack) if f.kind == "call"), None)

    def _open_tag(self, header: str, delta: ReplyDelta) -> None:
        m = _HEADER.match(header)
        name = m.group(1) if m else ""
        attrs = {k: html.unescape(v) for k, v in _ATTR.findall(m.group(2))} if m else {}
        call = self._current_call()
        if name in ("think", "response", "tools"):
            self._stack.append(_Frame(name))
        elif name == "call":
            index, self.num_calls = self.num_calls, self.num_calls + 1
            self._stack.append(_Frame("call", call=index))
            delta.add_call(ToolCallDelta(index, "", self._call_id(), attrs.get("tool", "")))
        elif name == "argument" and call is not None:
            string_arg = attrs.get("type", "string") == "string"
            prefix = ("," if call.wrote_args else "{") + json.dumps(attrs.get("name", ""), ensure_ascii=False) + ":"
            delta.add_call(ToolCallDelta(call.call, prefix + ('"' if string_arg else "")))
            call.wrote_args = True
            self._stack.append(_Frame("argument", call=call.call, string_arg=string_arg))
        elif name == "json" and call is not None and not call.wrote_args:
            call.wrote_args = call.json_body = True
            self._stack.append(_Frame("json", call=call.call))
        else:
            self._stack.append(_Frame("other"))

    def _close_tag(self, header: str, delta: ReplyDelta) -> None:
        m = _HEADER.match(header)
        name = m.group(1) if m else ""
        kinds = [f.kind for f in self._stack[1:]]
        if name not in kinds:
            if "other" in kinds:  # the close of an unknown tag
                while self._stack[-1].kind != "other":
                    self._pop(delta)
                self._pop(delta)
            return
        while self._stack[-1].kind != name:
            self._pop(delta)
        self._pop(delta)

    def _pop(self, delta: ReplyDelta) -> None:
        frame = self._stack.pop()
        if frame.kind == "argument" and frame.string_arg:
            delta.add_call(ToolCallDelta(frame.call, '"'))
        elif frame.kind == "call" and not frame.json_body:
            delta.add_call(ToolCallDelta(frame.call, "}" if frame.wrote_args else "{}"))


class ReplyAccumulator:
    """Sums `ReplyDelta`s into a `Reply` (the non-streaming response, and the client side of a stream)."""

    def __init__(self) -> None:
        self.reasoning = ""
        self.content = ""
        self.calls: dict[int, ToolCall] = {}

    def add(self, delta: ReplyDelta) -> None:
        self.reasoning += delta.reasoning
        self.content += delta.content
        for piece in delta.tool_calls:
            call = self.calls.setdefault(piece.index, ToolCall(piece.id or "", piece.name or "", ""))
            call.arguments += piece.arguments

    def reply(self, thinking: bool = False) -> Reply:
        calls = [self.calls[i] for i in sorted(self.calls)]
        content = self.content if (self.content or not calls) else None
        reasoning = self.reasoning if (self.reasoning or thinking) else None
        return Reply(content, reasoning, calls)


class ReplyStream:
    """Generated token ids → `ReplyDelta`s of one chat reply, with stop strings matched on its content.

    `feed(ids, finished)` parses the ids (`OutputParser`) and cuts the content at the first stop string
    (`StopMatcher`: a stream never shows the start of one); pass `finished=True` with the last ids. At a
    match `stopped` turns True, tool calls of that delta are dropped, and nothing more comes.
    """

    def __init__(self, tokenizer: Tokenizer, thinking: bool, stop: Sequence[str] = (), call_id=new_call_id):
        self.parser = OutputParser(tokenizer, thinking, call_id)
        self.stopper = StopMatcher(stop)

    @property
    def stopped(self) -> bool:
        return self.stopper.hit

    def feed(self, token_ids: Iterable[int], finished: bool = False) -> ReplyDelta:
        if self.stopped:
            return ReplyDelta()
        delta = self.parser.feed(token_ids)
        if finished:
            delta.extend(self.parser.finish())
        delta.content = self.stopper.feed(delta.content)
        if self.stopped:
            delta.tool_calls = []
        elif finished:
            delta.content += self.stopper.flush()
        return delta


def parse_reply(tokenizer: Tokenizer, token_ids: Iterable[int], thinking: bool) -> Reply:
    """The whole reply at once: tokens after the generation prompt → content, reasoning, tool calls."""
    parser = OutputParser(tokenizer, thinking)
    acc = ReplyAccumulator()
    acc.add(parser.feed(token_ids))
    acc.add(parser.finish())
    return acc.reply(thinking)
