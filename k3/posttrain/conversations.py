"""Conversations for supervised fine-tuning: the JSONL format, its validation, and rendering with the loss mask.

One conversation per line, OpenAI-shaped (docs/post-training.md has the full format):

    {"id": "arith-17", "reasoning_effort": "high", "tools": [...],
     "messages": [{"role": "system", "content": "…"}, {"role": "user", "content": "…"},
                  {"role": "assistant", "reasoning_content": "…", "content": "…",
                   "tool_calls": [{"id": "call_0", "type": "function",
                                   "function": {"name": "lookup", "arguments": "{\"key\": \"kiwi\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_0", "content": "12"}, …]}

Rendering goes through the server's chat template (`k3.chat.template.ChatTemplate.render_spans`), so the tokens are
the server's, token for token: the prompt before each assistant turn is exactly what `k3 serve` renders for that
history. The loss mask is the template's `written` flag (K3 report §4.1.1, App. F): the tokens the model writes
after each assistant turn's generation prompt (thinking, response, tool calls, closing tags and `<|end_of_msg|>`);
never system, user or tool-result messages, option messages, the generation prompt itself, or a raw-JSON arguments
block (input only).

Validation refuses what would train the wrong thing, naming the line and the field: malformed JSON, an unknown
role, tool-call arguments that are not JSON, a tool result answering no call, `reasoning_content` without a
`reasoning_effort` (instruct mode's generation prompt opens the response channel, so the model would never reach
the thinking it is taught), or no assistant turn at all. Conversations longer than the context are left out when
the corpus is prepared, and counted (`k3.train.data.prepare_corpus`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3.chat.template import ROLES, ChatTemplate, TemplateError, normalize_effort


class ConversationError(ValueError):
    """A conversation that cannot be trained on; the message names the field (and, from a file, the line)."""


@dataclass
class Conversation:
    """One training conversation. `id` (optional) names it and decides its held-out side: conversations sharing an
    id (one problem at several efforts, say) stay on the same side."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None
    id: str | None = None

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"id": self.id} if self.id is not None else {}
        if self.reasoning_effort is not None:
            record["reasoning_effort"] = self.reasoning_effort
        if self.tools:
            record["tools"] = self.tools
        record["messages"] = self.messages
        return record


@dataclass
class RenderedConversation:
    """Token ids [T] and loss mask [T] (1: a token the model writes, trained on) of one conversation, and for each
    assistant turn the (start, end) of what the model writes: `ids[:start]` is the server's prompt for that turn."""

    ids: list[int]
    loss_mask: list[int]
    turns: list[tuple[int, int]] = field(default_factory=list)


def parse_conversation(record: Any) -> Conversation:
    """A decoded JSON line → `Conversation`, checked for everything that does not need the tokenizer.
    Raises `ConversationError` naming the field."""
    if not isinstance(record, Mapping):
        raise ConversationError(f"expected a JSON object, got {type(record).__name__}")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ConversationError('"messages" must be a non-empty list')
    effort = record.get("reasoning_effort")
    try:
        thinking = normalize_effort(effort) is not None
    except TemplateError as e:
        raise ConversationError(str(e)) from e
    tools = record.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
        raise ConversationError('"tools" must be a list of objects')
    conv_id = record.get("id")
    if conv_id is not None and not isinstance(conv_id, str | int):
        raise ConversationError('"id" must be a string or an integer')
    for i, message in enumerate(messages):
        _check_message(message, f"messages[{i}]", thinking)
    if not any(m["role"] == "assistant" for m in messages):
        raise ConversationError("no assistant message: nothing to learn from")
    return Conversation(messages, tools, effort, None if conv_id is None else str(conv_id))


def _check_message(message: Any, param: str, thinking: bool) -> None:
    if not isinstance(message, Mapping):
        raise ConversationError(f"{param}: a message must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise ConversationError(f"{param}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
    if role != "assistant":
        return
    if message.get("reasoning_content") and not thinking:
        raise ConversationError(f"{param}: reasoning_content needs a reasoning_effort (low, high or max): without "
                                f"one the conversation is in instruct mode, whose generation prompt opens the "
                                f"response channel, so the thinking could never be generated")
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ConversationError(f"{param}.tool_calls must be a list")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise ConversationError(f"{param}.tool_calls[{j}]: a tool call needs a function object")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise ConversationError(f"{param}.tool_calls[{j}].function.arguments must be a JSON string")
        try:
            json.loads(arguments)
        except ValueError as e:
            raise ConversationError(f"{param}.tool_calls[{j}].function.arguments is not JSON ({e}): "
                                    f"{arguments[:60]!r}") from e


def render_conversation(template: ChatTemplate, conversation: Conversation) -> RenderedConversation:
    """Render through the server's chat template; the loss mask marks the tokens the model writes (module docstring).
    Raises `ConversationError` for what the template refuses."""
    try:
        spans = template.render_spans(conversation.messages, tools=conversation.tools,
                                      reasoning_effort=conversation.reasoning_effort, add_generation_prompt=False)
    except TemplateError as e:
        raise ConversationError(f"{e.param}: {e}" if e.param else str(e)) from e
    ids: list[int] = []
    mask: list[int] = []
    turns: list[tuple[int, int]] = []
    start = None  # where the current turn's written tokens began (a raw-JSON arguments block only pauses them)
    for span in spans:
        if span.written and start is None:
            start = len(ids)
        ids += span.ids
        mask += [int(span.written)] * len(span.ids)
        if span.written and span.ids[-1] == template.end_id:
            turns.append((start, len(ids)))
            start = None
    return RenderedConversation(ids, mask, turns)


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """(line number, line) of every non-blank line; a line that is not UTF-8 is an error naming it."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConversationError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start} of the line)") from e
            if line.strip():
                yield lineno, line.strip()


def parse_line(line: str, where: str) -> Conversation:
    """One JSONL line → `Conversation`; errors start with `where` (e.g. "data.jsonl:3")."""
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ConversationError(f"{where}: not valid JSON ({e})") from e
    try:
        return parse_conversation(record)
    except ConversationError as e:
        raise ConversationError(f"{where}: {e}") from e


def read_conversations(path: str | os.PathLike) -> list[tuple[str, Conversation]]:
    """(where, conversation) for every line of a JSONL file, `where` = "FILE:LINE". Raises `ConversationError`
    (a ValueError) naming the first bad line."""
    if not Path(path).is_file():
        raise ConversationError(f"{path} is not a file (expected JSONL conversations, one per line)")
    found = [(f"{path}:{lineno}", parse_line(line, f"{path}:{lineno}")) for lineno, line in iter_jsonl(path)]
    if not found:
        raise ConversationError(f"{path} holds no conversations")
    return found


def write_conversations(conversations: Sequence[Conversation], path: str | os.PathLike) -> None:
    """Write JSONL, one conversation a line (non-ASCII kept), replacing `path` in one step."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for conversation in conversations:
                f.write(json.dumps(conversation.to_json(), ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
