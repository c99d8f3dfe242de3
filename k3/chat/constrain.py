"""Grammars of constrained chat replies, in K3's XTML markup: JSON output and forced tool calls.

`reply_grammar` turns a request's `response_format` and `tool_choice` into a Lark grammar (llguidance's
dialect, compiled by `k3.infer.grammar.GrammarCompiler`) over what the model writes after
`ChatTemplate.generation_prompt`. Special tokens are named by id (`<[id]>`), so the markup is the template's
own; JSON is a `%json {schema}` rule with compact separators (no free whitespace, which a weak model could
repeat until `max_tokens`). The reply, for each case (instruct mode; thinking mode first writes free think
text, then `<|close|>think<|sep|><|open|>response<|sep|>`):

    json_object / json_schema:   JSON <|close|>response<|sep|><|end_of_msg|>
    tool_choice required / named:
        <|close|>response<|sep|><|open|>tools<|sep|>
            <|open|>call tool="NAME" index="0"<|sep|><|open|>json<|sep|>ARGS<|close|>json<|sep|><|close|>call<|sep|>
            … (more calls, index 1, 2, …, when parallel_tool_calls and tool_choice is required)
        <|close|>tools<|sep|><|end_of_msg|>

Arguments are one `json` block (the template's form for a whole JSON object, which `OutputParser` streams as
the arguments string as it comes) validated by the function's `parameters`. `tool_choice` auto (the model
chooses) and none are not constrained; `response_format` then still constrains the content.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from k3.chat.template import ChatTemplate, header_attrs
from k3.tokenizer import KIMI_PAT_STR, Tokenizer

MAX_PARALLEL_CALLS = 8  # calls one constrained reply may hold (tool_choice required, parallel_tool_calls)
# compact JSON: one space of freedom is one more way for a weak model to loop until max_tokens
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
ANY_OBJECT = {"type": "object"}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def grammar_vocabulary(tokenizer: Tokenizer) -> dict[str, Any]:
    """The arguments of `k3.infer.grammar.GrammarCompiler` for this tokenizer: the base vocabulary's bytes as
    text, the specials and an undertrained BPE's unused placeholders as tokens text never produces."""
    specials = dict(tokenizer.special_tokens)
    text = {}
    for piece, token_id in tokenizer.mergeable_ranks().items():
        # placeholders (`<|bpe_unused_{id}|>`, see k3.tokenizer.train_bpe) are no text
        if tokenizer.kind == "bpe" and token_id >= 256 and piece == f"<|bpe_unused_{token_id}|>".encode():
            specials[piece.decode()] = token_id
        else:
            text[piece] = token_id
    return {"text_tokens": text, "special_tokens": specials, "eos_id": tokenizer.eos_id,
            "vocab_size": tokenizer.vocab_size, "pattern": KIMI_PAT_STR}


def _json_rule(schema: Mapping[str, Any]) -> str:
    schema = dict(schema)
    schema["x-guidance"] = {**_JSON_OPTIONS, **schema.get("x-guidance", {})}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def response_schema(response_format: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The JSON schema a `response_format` asks for (json_object: any object), or None for text."""
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        return (response_format.get("json_schema") or {}).get("schema") or ANY_OBJECT
    return None


def forced_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any) -> list[Mapping[str, Any]]:
    """The functions a reply must call from: all for `required`, one for a named choice, none otherwise."""
    if not tools:
        return []
    if tool_choice == "required":
        return [t["function"] for t in tools]
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        return [t["function"] for t in tools if t["function"].get("name") == name]
    return []


def reply_grammar(template: ChatTemplate, *, thinking: bool, tools: Sequence[Mapping[str, Any]] | None = None,
                  tool_choice: Any = None, parallel_tool_calls: bool = True,
                  response_format: Mapping[str, Any] | None = None) -> str | None:
    """The Lark grammar of the reply (see the module docstring), or None when nothing constrains it."""
    o, c, s, end = (f"<[{i}]>" for i in (template.open_id, template.close_id, template.sep_id, template.end_id))

    def tag(open_: str, text: str) -> str:
        return f"{open_} {json.dumps(text)} {s}"

    functions = forced_tools(tools, tool_choice)
    schema = response_schema(response_format)
    if not functions and schema is None:
        return None
    rules = []
    head = ""
    if thinking:
        head = f"THINK {tag(c, 'think')} {tag(o, 'response')} "
        rules.append(r"THINK: /(.|\n)*/")
    if functions:
        count = MAX_PARALLEL_CALLS if parallel_tool_calls and tool_choice == "required" else 1
        calls = [f"call{i}" for i in range(count)]
        body = calls[0] + "".join(f" ({c_}" for c_ in calls[1:]) + ")?" * (count - 1)
        rules.insert(0, f"start: {head}{tag(c, 'response')} {tag(o, 'tools')} {body} {tag(c, 'tools')} {end}")
        for i in range(count):
            alts = [f"{tag(o, 'call' + header_attrs({'tool': f['name'], 'index': i}))} {tag(o, 'json')} args{k} "
                    f"{tag(c, 'json')} {tag(c, 'call')}" for k, f in enumerate(functions)]
            rules.append(f"call{i}: " + " | ".join(alts))
        for k, f in enumerate(functions):
            rules.append(f"args{k}: " + _json_rule(f.get("parameters") or NO_ARGUMENTS))
    else:
        rules.insert(0, f"start: {head}content {tag(c, 'response')} {end}")
        rules.append("content: " + _json_rule(schema))
    return "\n".join(rules) + "\n"
