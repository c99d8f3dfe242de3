"""The SFT conversation format: loss masks on hand-written conversations, the rendering equals the server's prompt
before every assistant turn, the written tokens parse back into the messages, and every kind of bad input is
refused naming its line."""

from __future__ import annotations

import json

import pytest

from k3.chat.template import ChatTemplate, parse_reply
from k3.posttrain.conversations import (Conversation, ConversationError, parse_conversation, read_conversations,
                                        render_conversation, write_conversations)
from k3.posttrain.sft import Conversations

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]

AGENT = {
    "id": "agent-1", "reasoning_effort": "high", "tools": TOOLS,
    "messages": [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Price of 3 kiwis?"},
        {"role": "assistant", "reasoning_content": "Look up kiwi.", "content": None,
         "tool_calls": [{"id": "a", "type": "function",
                         "function": {"name": "lookup", "arguments": '{"key": "kiwi"}'}},
                        {"id": "b", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "fig"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "12"},
        {"role": "tool", "tool_call_id": "b", "content": "5"},
        {"role": "assistant", "reasoning_content": "3*12.", "content": "",
         "tool_calls": [{"id": "c", "type": "function",
                         "function": {"name": "calculator", "arguments": '{"expression": "3*12", "exact": true}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "36"},
        {"role": "assistant", "reasoning_content": "Done.", "content": "36 dollars."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "reasoning_content": "", "content": "You're welcome."},
    ]}


@pytest.fixture(scope="module")
def template(tokenizer):
    return ChatTemplate(tokenizer)


def written_text(tokenizer, rendered):
    """The masked tokens of each turn, decoded."""
    return [tokenizer.decode([t for t, m in zip(rendered.ids[a:b], rendered.loss_mask[a:b]) if m])
            for a, b in rendered.turns]


def test_mask_of_a_tool_using_conversation_with_several_assistant_turns(tokenizer, template):
    rendered = render_conversation(template, parse_conversation(AGENT))
    assert len(rendered.ids) == len(rendered.loss_mask)
    think = "<|close|>think<|sep|><|open|>response<|sep|>"
    end = "<|close|>response<|sep|>"
    calls = ('<|open|>tools<|sep|><|open|>call tool="lookup" index="0"<|sep|><|open|>argument name="key"<|sep|>kiwi'
             '<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="lookup" index="1"<|sep|>'
             '<|open|>argument name="key"<|sep|>fig<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
    calc = ('<|open|>tools<|sep|><|open|>call tool="calculator" index="0"<|sep|><|open|>argument name="expression"'
            '<|sep|>3*12<|close|>argument<|sep|><|open|>argument name="exact" type="json"<|sep|>true'
            '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
    assert written_text(tokenizer, rendered) == [
        f"Look up kiwi.{think}{end}{calls}<|end_of_msg|>",
        f"3*12.{think}{end}{calc}<|end_of_msg|>",
        f"Done.{think}36 dollars.{end}<|end_of_msg|>",
        f"{think}You're welcome.{end}<|end_of_msg|>",
    ]
    # nothing outside the assistant turns is trained: system, user, tool results, options, generation prompts
    inside = {i for a, b in rendered.turns for i in range(a, b)}
    assert all(not m for i, m in enumerate(rendered.loss_mask) if i not in inside)
    assert sum(rendered.loss_mask) == sum(rendered.loss_mask[a:b].count(1) for a, b in rendered.turns)


def test_every_turn_starts_where_the_server_prompt_ends_and_parses_back(tokenizer, template):
    rendered = render_conversation(template, parse_conversation(AGENT))
    messages = AGENT["messages"]
    assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(rendered.turns) == len(assistant_at)
    for (start, end), k in zip(rendered.turns, assistant_at):
        # the SFT tokens before the turn are the server's prompt for that history, token for token
        prompt = template.render(messages[:k], tools=TOOLS, reasoning_effort="high")
        assert rendered.ids[:start] == prompt
        # render, then parse: the model's tokens of the turn give back the message
        reply = parse_reply(tokenizer, rendered.ids[start:end], thinking=True)
        message = messages[k]
        assert reply.reasoning_content == message["reasoning_content"]
        assert (reply.content or "") == (message["content"] or "")
        want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
        assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == want
    # the whole conversation is what the server renders for its full history
    assert rendered.ids == template.render(messages, tools=TOOLS, reasoning_effort="high", add_generation_prompt=False)


def test_instruct_mode_and_the_json_fallback_are_masked_as_the_spec_says(tokenizer, template):
    conversation = parse_conversation({"messages": [
        {"role": "user", "content": "List?"},
        {"role": "assistant", "content": "Here.",
         "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "[1, 2]"}}]},
        {"role": "tool", "tool_call_id": "x", "content": "ok"},
        {"role": "assistant", "content": "Done."}]})
    rendered = render_conversation(template, conversation)
    # instruct mode: the generation prompt opens the response channel, so the turn starts with the content
    assert written_text(tokenizer, rendered) == [
        'Here.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="0"<|sep|>'
        '<|close|>call<|sep|><|close|>tools<|sep|><|end_of_msg|>',
        "Done.<|close|>response<|sep|><|end_of_msg|>"]
    # the raw-JSON arguments block is rendered (input only) but never a target
    a, b = rendered.turns[0]
    text = tokenizer.decode(rendered.ids[a:b])
    assert "<|open|>json<|sep|>[1, 2]<|close|>json<|sep|>" in text
    assert rendered.ids[:a] == template.render(conversation.messages[:1])


BAD_LINES = [
    ('{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"messages": []}', '"messages" must be a non-empty list'),
    ('{"messages": [{"role": "bot", "content": "hi"}]}', "messages[0]: unknown role 'bot'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "a", "function": {"name": "f", '
     '"arguments": "{not json"}}]}]}', "messages[0].tool_calls[0].function.arguments is not JSON"),
    ('{"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "a", "function": {"name": "f", '
     '"arguments": {"k": 1}}}]}]}', "arguments must be a JSON string"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "reasoning_content": "hm", '
     '"content": "a"}]}', "reasoning_content needs a reasoning_effort"),
    ('{"reasoning_effort": "huge", "messages": [{"role": "assistant", "content": "a"}]}', "reasoning_effort must be"),
    ('{"tools": {"a": 1}, "messages": [{"role": "assistant", "content": "a"}]}', '"tools" must be a list'),
    # refused by the chat template itself, found when the file is read (before anything trains)
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "nope", "content": "1"}, '
     '{"role": "assistant", "content": "a"}]}', "messages[1].tool_call_id: tool message answers unknown"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}, {"role": "assistant", "content": "a"}]}',
     "messages[0].content[0]: content part of type 'image_url'"),
]


@pytest.mark.parametrize("line, message", BAD_LINES)
def test_bad_input_is_refused_naming_the_line(tmp_path, tokenizer, line, message):
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    path = tmp_path / "data.jsonl"
    path.write_text(f"{good}\n\n{good}\n{line}\n{good}\n")
    with pytest.raises(ConversationError) as e:
        Conversations(path, tokenizer).documents()
    assert str(e.value).startswith(f"{path}:4: ")
    assert message in str(e.value)


def test_files_that_are_not_conversations(tmp_path, tokenizer):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"messages": [{"role": "assistant", "content": "\xff"}]}\n')
    with pytest.raises(ConversationError, match=r"x.jsonl:1: not valid UTF-8"):
        read_conversations(path)
    path.write_text("\n\n")
    with pytest.raises(ConversationError, match="holds no conversations"):
        read_conversations(path)
    with pytest.raises(ConversationError, match="is not a file"):
        read_conversations(tmp_path)


def test_write_then_read_and_document_names(tmp_path, tokenizer):
    conversations = [parse_conversation(AGENT), Conversation([{"role": "assistant", "content": "é ✓"}])]
    path = tmp_path / "c.jsonl"
    write_conversations(conversations, path)
    read = [c for _, c in read_conversations(path)]
    assert [c.to_json() for c in read] == [c.to_json() for c in conversations]
    # a conversation is named by its id (the held-out split follows it), else by FILE:LINE
    names = [name for name, _ in Conversations(path, tokenizer).documents()]
    assert names == ["agent-1", f"{path}:2"]
