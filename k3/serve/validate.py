"""Request validation: the body (UTF-8, JSON, nesting, the pydantic model), the API key, the model name, the
fields the models cannot check alone, the completion budget and the engine's `SamplingParams`.

Every failure raises an `APIError` whose `param` names the offending field (`messages[0].role`), so bad input
is a 4xx, never a 5xx.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from k3.infer.api import RequestTooLargeError, SamplingParams
from k3.serve import protocol as P
from k3.serve.errors import APIError, bad_request
from k3.serve.state import AppState

MAX_JSON_DEPTH = 64


def param_path(loc: Sequence[Any]) -> str | None:
    """A pydantic error location → an OpenAI `param` ("messages[0].role")."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part not in ("str", "list", "int", "float", "bool", "dict") \
                and not part.startswith(("list[", "function-", "tagged-union[", "literal[", "constrained-")):
            out += ("." if out else "") + part
    return out or None


def check_json(body: Any) -> None:
    """Reject nesting deeper than MAX_JSON_DEPTH (later steps recurse) and strings that are not valid Unicode
    (lone surrogates from `\\ud800` escapes). Iterative, so it cannot itself overflow the stack."""
    stack = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", path or None)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request("string is not valid UTF-8 (lone surrogate)", path or None) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, path, depth + 1))
                stack.append((v, f"{path}.{k}" if path else str(k), depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


async def read_raw(request: Request, limit: int) -> bytes:
    """The body's bytes, or a 413 naming the limit as soon as it is passed (before any parsing or tokenizing)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body holds {size} bytes or more; this server accepts at most {limit} bytes "
                    "per request (k3 serve --max-request-bytes)", code="request_too_large")


async def read_body(request: Request, model: type[BaseModel], limit: int) -> tuple[Any, dict[str, Any]]:
    """`read_raw` then `parse_body` (on the event loop: for small bodies only; the handlers parse in a worker)."""
    return parse_body(await read_raw(request, limit), model)


def parse_body(raw: bytes, model: type[BaseModel]) -> tuple[Any, dict[str, Any]]:
    """Parse and validate a JSON request body → (the model, the raw dict); every failure is a 400 naming its field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    check_json(body)
    try:
        return model.model_validate(body), body
    except ValidationError as e:
        errors = e.errors(include_url=False)
        # of a union's alternatives, report one that got the right type but a wrong value, if any
        err = next((x for x in errors if not x["type"].endswith("_type")), errors[0])
        param = param_path(err["loc"])
        where = f"{param}: " if param else ""
        raise bad_request(f"{where}{err['msg']}", param) from None


def authorize(state: AppState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                       "authentication_error", code="invalid_api_key")


def check_model(state: AppState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                       "not_found_error", "model", "model_not_found")


def check_chat(req: P.ChatCompletionRequest) -> None:
    """What a chat request's model cannot check field by field: logprobs and tool options that need another field."""
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if req.tool_choice not in (None, "none") and not req.tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if isinstance(req.tool_choice, P.NamedToolChoice):
        if req.tool_choice.function.name not in {t.function.name for t in req.tools or []}:
            raise bad_request(f"tool_choice names an unknown function {req.tool_choice.function.name!r}",
                              "tool_choice")


def check_schemas(body: dict[str, Any]) -> None:
    """Tool and response schemas must be valid JSON Schema (checked against the meta-schema of the draft they
    name, 2020-12 by default): otherwise a 400 naming the parameter."""
    import jsonschema

    found = []
    for i, tool in enumerate(body.get("tools") or []):
        params = (tool.get("function") or {}).get("parameters")
        if params is not None:
            found.append((params, f"tools[{i}].function.parameters"))
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad_request("response_format json_schema needs json_schema: {name, schema, strict}",
                              "response_format.json_schema")
        if "schema" in spec:
            found.append((spec["schema"], "response_format.json_schema.schema"))
    for schema, param in found:
        if not isinstance(schema, dict):
            raise bad_request("a JSON schema must be an object", param)
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "(root)"
            raise bad_request(f"not a valid JSON Schema at {where}: {e.message}", param) from None


def check_completion(state: AppState, req: P.CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (no server-side ranking)", "best_of")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt is scored, nothing generated)",
                          "max_tokens")
    if req.echo and req.logprobs is not None and state.scorer is None:
        raise bad_request("this server's engine cannot score prompts, so echo with logprobs is not available",
                          "logprobs")


def check_prompt_fits(state: AppState, prompt_len: int, param: str) -> None:
    """A prompt that is only scored (max_tokens 0) needs no room for a completion, only to fit the context."""
    if prompt_len > state.max_context:
        raise bad_request(f"the prompt holds {prompt_len} tokens; this model's context is {state.max_context} tokens",
                          param, "context_length_exceeded")


def completion_prompts(state: AppState, req: P.CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """A completion's `prompt` (a string, strings, token ids or lists of them) → (token ids, text) per prompt."""
    tokenizer = state.tokenizer
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        prompts = [raw]
    else:
        prompts = list(raw)
    ids_list, texts = [], []
    # one batch call: it releases the GIL while it tokenizes, so the event loop keeps answering
    encoded = iter(tokenizer.encode_batch([p for p in prompts if isinstance(p, str)]))
    for p_index, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{p_index}]"
        if isinstance(p, str):
            if not p:
                raise bad_request("the prompt is empty", param)
            ids_list.append([tokenizer.bos_id] + next(encoded))
            texts.append(p)
        else:
            if any(t < 0 or t >= tokenizer.vocab_size for t in p):
                raise bad_request(f"token ids must be in [0, {tokenizer.vocab_size})", param)
            ids_list.append(list(p))
            texts.append(tokenizer.decode(p))
    return ids_list, texts


def completion_budget(state: AppState, prompt_len: int, requested: int | None, param: str, prompt_param: str) -> int:
    """The completion budget (`max_tokens`), or a 400 `context_length_exceeded`."""
    room = state.max_context - prompt_len
    if room < 1:
        raise bad_request(f"the prompt holds {prompt_len} tokens; this model's context is {state.max_context} "
                          "tokens including at least one completion token", prompt_param, "context_length_exceeded")
    if requested is None:
        return room if state.default_max_tokens is None else min(room, state.default_max_tokens)
    if requested > room:
        raise bad_request(f"this model's context is {state.max_context} tokens; you asked for {prompt_len} in the "
                          f"prompt plus {requested} completion tokens", param, "context_length_exceeded")
    return requested


def check_admissible(state: AppState, totals: list[int]) -> None:
    """A 400 when the engine could never admit these requests together (n choices × prompt + max_tokens), so
    that a client is not told to retry (503) what can never run."""
    check = getattr(state.engine, "check_admissible", None)
    if check is None:
        return
    try:
        check(totals)
    except RequestTooLargeError as e:
        raise bad_request(str(e), "n", "request_too_large") from None


def sampling_params(state: AppState, req: P._Sampling, max_tokens: int, seed_offset: int,
                    logprobs: int | None, grammar: Any = None) -> SamplingParams:
    """The engine's `SamplingParams` of choice `seed_offset` (its seed is the request's + the offset)."""
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    if top_p == 0.0:  # only the most likely token: greedy
        temperature, top_p = 0.0, 1.0
    seed = None if req.seed is None else (req.seed + seed_offset) % 2**63
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=req.top_k or 0, top_p=top_p,
        min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty, seed=seed,
        stop_token_ids=tuple(state.tokenizer.stop_ids), logprobs=logprobs, grammar=grammar)
    try:
        params.validate(state.tokenizer.vocab_size)
    except ValueError as e:
        raise bad_request(str(e), str(e).split(":")[0]) from None
    return params
