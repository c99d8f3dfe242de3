"""Grammar-constrained decoding (k3/infer/grammar.py, k3/chat/constrain.py) on the debug preset with random weights.

The engine's constrained path (mask filled in a worker thread during the forward, unpacked on the device,
batched with unconstrained rows) must give exactly the tokens of the plain loop (`generate_steps`: its own
matchers, the bit-by-bit reference unpacking), greedy and sampled; preemption and prefix caching change
nothing; and every sampled reply parses and validates against its schema (100 %, many seeds).
"""

import json

import jsonschema
import pytest
import torch

from k3.chat.constrain import grammar_vocabulary, reply_grammar
from k3.chat.template import ChatTemplate, parse_reply
from k3.infer.api import RequestOutput, SamplingParams
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine, merge_output
from k3.infer.generate import generate_steps
from k3.infer.grammar import (
    GrammarCompiler,
    fill_bitmask,
    naive_unpack_bitmask,
    unpack_bitmask,
)
from k3.infer.sampling import sample

CFG = EngineConfig(hash_block_size=8, page_tokens=16, prefill_chunk_tokens=16, checkpoint_every_blocks=2,
                   num_pages=400, max_step_tokens=256, max_running=32, eos_token_ids=(), short_budget_tokens=10**6)
# bounded, so that a random model always finishes: strings have maxLength, numbers ranges, arrays maxItems
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["C", "F"]},
        "alerts": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "where": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
                  "required": ["lat"], "additionalProperties": False},
    },
    "required": ["city", "days", "unit", "alerts", "where"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(**grammar_vocabulary(tokenizer))


@pytest.fixture(scope="module")
def template(tokenizer):
    return ChatTemplate(tokenizer)


def run_all(engine, requests):
    """requests: (request_id, prompt, sampling) all added at once -> request_id -> merged RequestOutput."""
    outs = {}
    for rid, ids, sp in requests:
        engine.add_request(rid, ids, sp)
        outs[rid] = RequestOutput(rid, [])
    while engine.has_unfinished():
        for out in engine.step():
            merge_output(outs[out.request_id], out)
    return outs


def test_unpack_equals_reference():
    g = torch.Generator().manual_seed(0)
    for V in (1, 31, 32, 33, 515):
        words = torch.randint(-2**31, 2**31 - 1, (3, (V + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
        assert torch.equal(unpack_bitmask(words, V), naive_unpack_bitmask(words, V))


def test_masked_sampling_equals_masked_logits():
    """The sampler's mask equals filling the logits with -inf first (the reference), greedy and sampled."""
    g = torch.Generator().manual_seed(1)
    N, V = 6, 300
    logits = torch.randn(N, V, generator=g)
    allowed = torch.rand(N, V, generator=g) < 0.1
    allowed[:, 7] = True
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, repetition_penalty=r)
              for t, p, k, r in ((0, 1, 0, 1), (1, 1, 0, 1), (0.7, 0.9, 0, 1), (1.3, 1, 20, 1.2), (1, 0.5, 5, 1),
                                 (0, 1, 0, 1.5))]
    gens = lambda: [torch.Generator().manual_seed(100 + i) for i in range(N)]
    prompts = [[7, 8, 9]] * N
    tokens, _ = sample(logits, params, gens(), prompts, [[]] * N, allowed)
    ref, _ = sample(logits.masked_fill(~allowed, float("-inf")), params, gens(), prompts, [[]] * N)
    assert tokens == ref
    assert all(allowed[i, t] for i, t in enumerate(tokens))


def test_compiled_grammars_are_cached(compiler, template):
    lark = reply_grammar(template, thinking=False, response_format={"type": "json_object"})
    first = compiler.compile(lark)
    misses = compiler.misses
    assert compiler.compile(lark) is first and compiler.misses == misses and compiler.hits >= 1
    assert first.matcher() is not first.matcher()  # each sequence its own matcher


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_equals_reference_loop_under_a_grammar(model, tokenizer, compiler, template, temperature):
    grammar = compiler.compile(reply_grammar(template, thinking=False, tools=TOOLS, tool_choice="required"))
    prompt = template.render(USER, tools=TOOLS, tool_choice="required")
    sp = SamplingParams(max_tokens=300, temperature=temperature, seed=5, grammar=grammar,
                        stop_token_ids=tuple(tokenizer.stop_ids))
    steps = list(generate_steps(model, torch.tensor([prompt]), sp, torch.Generator().manual_seed(5)))
    ref = [int(s.tokens[0]) for s in steps]
    # batched with an unconstrained request and another constrained one
    free = SamplingParams(max_tokens=40, temperature=1.0, seed=6)
    out = run_all(Engine(model, CFG), [("a", prompt, sp), ("b", prompt[:-3], free), ("c", prompt, sp)])
    assert out["a"].new_token_ids == ref == out["c"].new_token_ids
    assert out["a"].finish_reason == "stop" and ref[-1] == tokenizer.eos_id


def test_preemption_and_prefix_caching_change_nothing(model, tokenizer, compiler, template):
    small = {"type": "object", "properties": {"days": SCHEMA["properties"]["days"], "unit": {"enum": ["C", "F"]}},
             "required": ["days", "unit"], "additionalProperties": False}
    grammar = compiler.compile(reply_grammar(template, thinking=False, response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": small}}))
    prompt = template.render(USER)
    reqs = [(f"r{i}", prompt + [100 + i] * (5 * i), SamplingParams(max_tokens=60, temperature=1.0, seed=i,
                                                                   grammar=grammar))
            for i in range(4)]
    roomy = run_all(Engine(model, CFG), reqs)
    tight = Engine(model, CFG.replace(num_pages=30, max_step_tokens=64))
    squeezed = run_all(tight, reqs)
    assert tight.metrics()["preemptions_total"] > 0
    cached = Engine(model, CFG.replace(enable_prefix_caching=True))
    run_all(cached, reqs[:1])
    again = run_all(cached, reqs)
    assert again["r0"].cached_tokens > 0
    for rid in roomy:
        assert squeezed[rid].new_token_ids == roomy[rid].new_token_ids == again[rid].new_token_ids, rid
        assert roomy[rid].finish_reason == "stop"


@pytest.mark.parametrize("case,n", [("json_object", 8), ("json_schema", 8), ("required", 8), ("named", 8),
                                    ("parallel", 8), pytest.param("json_schema", 64, marks=pytest.mark.slow),
                                    pytest.param("parallel", 64, marks=pytest.mark.slow)])
def test_every_sampled_reply_parses_and_validates(model, tokenizer, compiler, template, case, n):
    """Seeded samples at temperature 1 from the random-weight model: 100 % parse and validate (a bounded schema;
    `json_object` allows unbounded strings, which a random model may write until max_tokens: those are cut)."""
    tools = tool_choice = response_format = None
    if case == "json_object":
        response_format = {"type": "json_object"}
    elif case == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    else:
        tools = TOOLS
        tool_choice = {"type": "function", "function": {"name": "get_time"}} if case == "named" else "required"
    lark = reply_grammar(template, thinking=False, tools=tools, tool_choice=tool_choice,
                         parallel_tool_calls=case == "parallel", response_format=response_format)
    grammar = compiler.compile(lark)
    prompt = template.render(USER, tools=tools, tool_choice=tool_choice, response_format=response_format)
    budget = 1000 if case == "parallel" else 600  # up to 8 calls
    reqs = [(f"s{i}", prompt, SamplingParams(max_tokens=budget, temperature=1.0, seed=1000 + i, grammar=grammar,
                                             stop_token_ids=tuple(tokenizer.stop_ids))) for i in range(n)]
    outs = run_all(Engine(model, CFG), reqs)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    counts = set()
    for out in outs.values():
        if case == "json_object" and out.finish_reason == "length":
            continue
        assert out.finish_reason == "stop"
        reply = parse_reply(tokenizer, out.new_token_ids, thinking=False)
        if response_format is not None:
            value = json.loads(reply.content)
            assert isinstance(value, dict)
            if case == "json_schema":
                jsonschema.validate(value, SCHEMA)
            assert not reply.tool_calls
        else:
            assert reply.tool_calls and not reply.content
            counts.add(len(reply.tool_calls))
            for call in reply.tool_calls:
                if case == "named":
                    assert call.name == "get_time"
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    if case in ("required", "named"):
        assert counts == {1}


def test_thinking_grammar_accepts_the_template_reply(tokenizer, compiler, template):
    """In thinking mode the grammar takes free think text, then the response channel with the JSON."""
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    grammar = compiler.compile(reply_grammar(template, thinking=True, response_format=fmt))
    value = {"city": "Paris", "days": 3, "unit": "C", "alerts": [True], "where": {"lat": 48}}
    message = {"role": "assistant", "reasoning_content": "hmm\nlet me think <|open|>", "content": json.dumps(
        value, separators=(",", ":"))}
    head = template.open_tag("think")
    ids = template.assistant_body(message, thinking=True)[len(head):] + [template.end_id]
    m = grammar.matcher()
    assert m.consume_tokens(ids) and m.is_stopped()
    spaced = dict(message, content=json.dumps(value))  # free whitespace is not allowed
    ids = template.assistant_body(spaced, thinking=True)[len(head):]
    assert grammar.matcher().validate_tokens(ids) < len(ids)


def test_fill_bitmask_rows_without_a_matcher_allow_everything(compiler, template):
    grammar = compiler.compile(reply_grammar(template, thinking=False, response_format={"type": "json_object"}))
    V = compiler.vocab_size
    allowed = unpack_bitmask(fill_bitmask([None, grammar.matcher()], V), V)
    assert allowed[0].all()
    assert allowed[1].sum() >= 1 and not allowed[1].all()
