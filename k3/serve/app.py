"""The OpenAI-compatible HTTP server: a FastAPI app over the inference engine (systems.md §9).

`create_app(engine, tokenizer, model_name)` serves `POST /v1/chat/completions`, `POST /v1/completions`,
`GET /v1/models`, `GET /health` and `GET /metrics`. The app talks to the engine only through its
token-level API (`k3.infer.api`): it renders chats with `ChatTemplate`, submits token ids with
`SamplingParams`, and turns the `RequestOutput` stream back into OpenAI responses or SSE chunks.

Choices worth knowing:
- **n > 1** is n engine requests (ids `<response id>-<i>`, seeds `seed + i`), merged into one queue.
- **Stop strings** are matched here, on the visible text (the reply's `content` for chats, the text for
  completions), with a hold-back so a stream never shows the start of a stop string; the engine request is
  aborted on a match. The engine gets only the stop token ids (`<|end_of_msg|>`, `[EOS]`).
- **Errors** are OpenAI bodies `{"error": {message, type, param, code}}`: bad input is always a 4xx naming
  the offending `param`; `AdmissionError` becomes 429/503 with `Retry-After`; every response carries
  `x-request-id`. A streaming response checks admission before sending its headers, so a refused
  request is a status code, not an SSE error.
- **Disconnects**: a streaming response listens for the client going away and aborts its engine requests
  at once, even mid-prefill; a non-streaming one polls for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.infer.api import AdmissionError, ContextLengthError, RequestOutput, SamplingParams, TokenLogprob
from k3.infer.metrics import render_prometheus
from k3.serve import protocol as P
from k3.chat.template import (ChatTemplate, IncrementalDecoder, OutputParser, ReplyAccumulator, ReplyDelta,
                                    TemplateError, normalize_effort)
from k3.tokenizer import Tokenizer

log = logging.getLogger("k3.serve")

PING_SECONDS = 15.0  # `: ping` comments while a stream waits (long prefills), so proxies keep it open
# how long a stream waits for the engine's first event (its acceptance, or a refusal) before sending headers:
# a refusal within it is a 429/503 status, a later one an SSE error event; a first token ends it at once
ADMISSION_WAIT_SECONDS = 2.0
DISCONNECT_POLL_SECONDS = 0.5


class APIError(Exception):
    """An error answered as an OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return P.ErrorResponse(error=P.ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                 code=self.code)).dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _engine_error(e: BaseException) -> APIError:
    """An exception from the engine → the error the client gets."""
    if isinstance(e, AdmissionError):
        retry = max(0.0, float(e.retry_after))
        headers = {"Retry-After": str(max(1, math.ceil(retry))), "retry-after-ms": str(int(retry * 1000))}
        if e.status == 429:
            return APIError(429, str(e), "rate_limit_error", code="rate_limit_exceeded", headers=headers)
        return APIError(503, str(e), "overloaded_error", code="overloaded", headers=headers)
    if isinstance(e, ContextLengthError):
        return _bad(str(e), "messages", "context_length_exceeded")
    if isinstance(e, ValueError):
        return _bad(str(e))
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error",
                    headers={"x-should-retry": "false"})


def _param(loc: Sequence[Any]) -> str | None:
    """A pydantic error location → an OpenAI `param` ("messages[0].role")."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part not in ("str", "list", "int", "float", "bool", "dict") \
                and not part.startswith(("list[", "function-", "tagged-union[", "literal[", "constrained-")):
            out += ("." if out else "") + part
    return out or None


MAX_JSON_DEPTH = 64


def _check_json(body: Any) -> None:
    """Reject nesting deeper than MAX_JSON_DEPTH (later steps recurse) and strings that are not valid Unicode
    (lone surrogates from `\\ud800` escapes). Iterative, so it cannot itself overflow the stack."""
    stack = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _bad(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", path or None)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise _bad("string is not valid UTF-8 (lone surrogate)", path or None) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, path, depth + 1))
                stack.append((v, f"{path}.{k}" if path else str(k), depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


async def _read_body(request: Request, model: type[BaseModel]) -> tuple[Any, dict[str, Any]]:
    """Parse and validate a JSON request body; every failure is a 400 naming its field."""
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise _bad("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    _check_json(body)
    try:
        return model.model_validate(body), body
    except ValidationError as e:
        errors = e.errors(include_url=False)
        # of a union's alternatives, report one that got the right type but a wrong value, if any
        err = next((x for x in errors if not x["type"].endswith("_type")), errors[0])
        param = _param(err["loc"])
        where = f"{param}: " if param else ""
        raise _bad(f"{where}{err['msg']}", param) from None


class _TokenText:
    """Token id → (text, UTF-8 bytes) for logprobs; specials by name. Built lazily (it walks the vocabulary)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] | None = None

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if self._bytes is None:
            self._bytes = {i: b for b, i in self.tokenizer.mergeable_ranks().items()}
            self._bytes.update({i: name.encode() for name, i in self.tokenizer.special_tokens.items()})
        raw = self._bytes.get(int(token_id), b"")
        return raw.decode("utf-8", errors="replace"), list(raw)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back a tail that could start one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hit = False
        self._buf = ""

    def feed(self, text: str) -> str:
        if self.hit:
            return ""
        if not self.stops:
            return text
        self._buf += text
        cuts = [p for p in (self._buf.find(s) for s in self.stops) if p >= 0]
        if cuts:
            out, self._buf, self.hit = self._buf[:min(cuts)], "", True
            return out
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self._buf)), keep, -1):
                if self._buf.endswith(s[:k]):
                    keep = k
                    break
        out = self._buf[:len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return out

    def flush(self) -> str:
        out, self._buf = ("" if self.hit else self._buf), ""
        return out


_PING = object()


class _Run:
    """The engine requests of one API call, merged into one queue of (choice index, RequestOutput | error)."""

    def __init__(self, engine: Any, items: list[tuple[str, list[int], SamplingParams]]):
        self.engine = engine
        self.items = items
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = [False] * len(items)  # no more events wanted for this choice
        self._ended = [False] * len(items)  # the engine stream finished or failed
        self._held: list[tuple[int, Any]] = []
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.items))]

    async def _pump(self, i: int) -> None:
        request_id, prompt_ids, sampling = self.items[i]
        stream = self.engine.stream(request_id, prompt_ids, sampling)
        try:
            async for out in stream:
                if out.finished:
                    self._ended[i] = True
                self.queue.put_nowait((i, out))
                if out.finished:
                    break
            else:
                raise RuntimeError("the engine's stream ended without a finished output")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the consumer, which turns it into an HTTP error
            self._ended[i] = True
            self.queue.put_nowait((i, e))
        finally:
            if hasattr(stream, "aclose"):
                await stream.aclose()

    async def admitted(self, wait: float) -> None:
        """Wait up to `wait` seconds for the first event; raise the engine's error if any request was refused."""
        try:
            self._held.append(await asyncio.wait_for(self.queue.get(), wait))
        except asyncio.TimeoutError:
            pass
        while not self.queue.empty():
            self._held.append(self.queue.get_nowait())
        for _, item in self._held:
            if isinstance(item, BaseException):
                self.close()
                raise _engine_error(item)

    async def events(self, ping: float | None = None) -> AsyncIterator[Any]:
        """Yield (i, RequestOutput) until every choice is done; `_PING` after `ping` idle seconds; raise errors."""
        while not all(self.done):
            if self._held:
                i, item = self._held.pop(0)
            else:
                try:
                    i, item = await asyncio.wait_for(self.queue.get(), ping)
                except asyncio.TimeoutError:
                    yield _PING
                    continue
            if self.done[i]:
                continue
            if isinstance(item, BaseException):
                raise _engine_error(item)
            yield i, item

    def finish(self, i: int) -> None:
        """No more output wanted for choice i (it finished, or hit a stop string: then abort the engine request)."""
        self.done[i] = True
        if not self._ended[i]:
            self._ended[i] = True
            self._abort(self.items[i][0])

    def _abort(self, request_id: str) -> None:
        try:
            result = self.engine.abort(request_id)
            if inspect.isawaitable(result):
                asyncio.ensure_future(result)
        except Exception:  # an engine that already forgot the request
            pass

    def close(self) -> None:
        """Abort every unfinished engine request and stop the pumps (idempotent, never awaits)."""
        if self._closed:
            return
        self._closed = True
        for i in range(len(self.items)):
            self.done[i] = True
            if not self._ended[i]:
                self._ended[i] = True
                self._abort(self.items[i][0])
        for task in self._tasks:
            if not task.done():
                task.cancel()


class _Choice:
    """Turns one engine request's outputs into OpenAI pieces: text or a parsed reply, logprobs, finish."""

    def __init__(self, index: int, run: _Run, stops: Sequence[str]):
        self.index = index
        self.run = run
        self.stopper = StopMatcher(stops)
        self.token_ids: list[int] = []
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None

    def _account(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens, len(self.token_ids))
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)

    def _stopped(self) -> bool:
        if self.stopper.hit and self.finish_reason is None:
            self.finish_reason = "stop"
            self.run.finish(self.index)
        return self.stopper.hit


class _ChatChoice(_Choice):
    def __init__(self, index: int, run: _Run, stops: Sequence[str], parser: OutputParser, tools: bool,
                 parallel_tool_calls: bool):
        super().__init__(index, run, stops)
        self.parser = parser
        self.tools = tools
        self.parallel = parallel_tool_calls
        self.num_calls = 0

    def update(self, out: RequestOutput) -> ReplyDelta:
        """Account one output; return the visible delta (content cut at a stop string, tool calls filtered)."""
        self._account(out)
        delta = self.parser.feed(out.new_token_ids)
        if out.finished:
            delta.extend(self.parser.finish())
        delta.content = self.stopper.feed(delta.content)
        if self._stopped():
            delta.tool_calls = []
            return delta
        if out.finished:
            delta.content += self.stopper.flush()
        # calls are dropped when no tools were offered (or tool_choice is none), all but the first when not parallel
        delta.tool_calls = [c for c in delta.tool_calls if self.tools and (self.parallel or c.index == 0)]
        self.num_calls = max([self.num_calls] + [c.index + 1 for c in delta.tool_calls])
        if out.finished and self.finish_reason is None:
            self.finish_reason = "length" if out.finish_reason == "length" else \
                ("tool_calls" if self.num_calls else "stop")
            self.run.finish(self.index)
        return delta


class _TextChoice(_Choice):
    def __init__(self, index: int, run: _Run, stops: Sequence[str], tokenizer: Tokenizer, prefix: str = ""):
        super().__init__(index, run, stops)
        self.decoder = IncrementalDecoder(tokenizer)
        self.tokenizer = tokenizer
        self.prefix = prefix  # echo: the prompt's text, sent first

    def update(self, out: RequestOutput) -> str:
        self._account(out)
        # special tokens are not text (as vLLM's default skip_special_tokens)
        text = self.prefix + self.decoder.feed(t for t in out.new_token_ids if not self.tokenizer.is_special(t))
        self.prefix = ""
        if out.finished:
            text += self.decoder.flush()
        text = self.stopper.feed(text)
        if self._stopped():
            return text
        if out.finished:
            text += self.stopper.flush()
            if self.finish_reason is None:
                self.finish_reason = "length" if out.finish_reason == "length" else "stop"
                self.run.finish(self.index)
        return text


class _RequestIdMiddleware:
    """Gives every request an id (the client's `x-request-id`, or a new one) and echoes it on every response."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if 0 < len(given) <= 128 else "req_" + uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + [(b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:
            log.exception("request %s failed", request_id)
            # an unexpected failure: still an OpenAI error body (and never a retry), if nothing was sent yet
            if started:
                raise
            response = _engine_error(e).response()
            await response(scope, receive, send_with_id)


class EventStreamResponse(StreamingResponse):
    """SSE that also listens for the client leaving (even while no token is due), and calls `on_close` however
    it ends. (Starlette's own StreamingResponse notices a disconnect only at its next write under ASGI 2.4.)"""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def until_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        try:
            async with anyio.create_task_group() as group:
                async def first_to_end(fn) -> None:
                    try:
                        await fn()
                    except OSError:  # the connection is gone
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(first_to_end, stream)
                group.start_soon(first_to_end, until_disconnect)
        finally:
            self.on_close()
            await self.events.aclose()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _stream_chunk(model_cls: Any, include_usage: bool, **fields: Any) -> str:
    """One SSE event of a streamed (chat) completion; `usage` appears only when the client asked for it."""
    c = model_cls(**fields).dump()
    if not include_usage:
        del c["usage"]
    return _sse(c)


def create_app(engine: Any, tokenizer: Tokenizer, model_name: str, api_key: str | None = None,
               max_context: int | None = None, *, default_max_tokens: int | None = None, medium_effort: str = "high",
               ping_seconds: float = PING_SECONDS, admission_wait: float = ADMISSION_WAIT_SECONDS) -> FastAPI:
    """The OpenAI-compatible app over `engine` (a `k3.infer.engine.AsyncEngine` or anything with its
    `stream` / `abort` / `metrics`).

    `max_context`: prompt + completion tokens per request (default: the engine's `max_context`);
    `default_max_tokens`: completion budget when a request sets none (default: the rest of the context);
    `api_key`: when set, `/v1/*` needs `Authorization: Bearer <api_key>`.
    The app does not own the engine: whoever built it shuts it down (`k3 serve` does, after uvicorn exits).
    """
    if max_context is None:
        max_context = int(getattr(engine, "max_context", 4096))
    template = ChatTemplate(tokenizer, medium_effort=medium_effort)
    token_text = _TokenText(tokenizer)
    created = int(time.time())
    fingerprint = "fp_" + hashlib.blake2b(model_name.encode(), digest_size=5).hexdigest()

    app = FastAPI(title="k3", docs_url=None, redoc_url=None)
    app.add_middleware(_RequestIdMiddleware)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        return APIError(e.status_code, str(e.detail), kind).response()

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           "authentication_error", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def budget(prompt_len: int, requested: int | None, param: str, prompt_param: str) -> int:
        """The completion budget, or a 400 `context_length_exceeded`."""
        room = max_context - prompt_len
        if room < 1:
            raise _bad(f"the prompt holds {prompt_len} tokens; this model's context is {max_context} tokens "
                       "including at least one completion token", prompt_param, "context_length_exceeded")
        if requested is None:
            return room if default_max_tokens is None else min(room, default_max_tokens)
        if requested > room:
            raise _bad(f"this model's context is {max_context} tokens; you asked for {prompt_len} in the prompt "
                       f"plus {requested} completion tokens", param, "context_length_exceeded")
        return requested

    def sampling(req: P._Sampling, max_tokens: int, seed_offset: int, logprobs: int | None) -> SamplingParams:
        if req.logit_bias:
            raise _bad("logit_bias is not supported", "logit_bias")
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        if top_p == 0.0:  # only the most likely token: greedy
            temperature, top_p = 0.0, 1.0
        seed = None if req.seed is None else (req.seed + seed_offset) % 2**63
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_k=req.top_k or 0, top_p=top_p,
            min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty, seed=seed,
            stop_token_ids=tuple(tokenizer.stop_ids), logprobs=logprobs)
        try:
            params.validate(tokenizer.vocab_size)
        except ValueError as e:
            raise _bad(str(e), str(e).split(":")[0]) from None
        return params

    def usage(choices: Sequence[_Choice], prompt_tokens: int, cached: int, reasoning: int = 0) -> P.Usage:
        completion = sum(c.completion_tokens for c in choices)
        return P.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                       total_tokens=prompt_tokens + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached),
                       completion_tokens_details=P.CompletionTokensDetails(reasoning_tokens=reasoning))

    async def until_done(request: Request, run: _Run, consume: Callable[[], Any]) -> None:
        """Run `consume()` (non-streaming), aborting the engine requests if the client disconnects."""
        task = asyncio.ensure_future(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    return None
        finally:
            run.close()

    def chat_logprobs(entries: list[TokenLogprob] | None) -> list[P.ChatLogprob]:
        out = []
        for e in entries or []:
            text, raw = token_text(e.token_id)
            top = []
            for tid, lp in e.top:
                ttext, traw = token_text(tid)
                top.append(P.ChatLogprobTop(token=ttext, logprob=_finite(lp), bytes=traw))
            out.append(P.ChatLogprob(token=text, logprob=_finite(e.logprob), bytes=raw, top_logprobs=top))
        return out

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_prometheus(engine.metrics()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorize(request)
        return P.ModelList(data=[P.ModelCard(id=model_name, created=created, max_model_len=max_context)]).dump()

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request):
        authorize(request)
        check_model(name)
        return P.ModelCard(id=model_name, created=created, max_model_len=max_context).dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        req, body = await _read_body(request, P.ChatCompletionRequest)
        check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
        if req.tool_choice not in (None, "none") and not req.tools:
            raise _bad("tool_choice needs tools", "tool_choice")
        if isinstance(req.tool_choice, P.NamedToolChoice):
            if req.tool_choice.function.name not in {t.function.name for t in req.tools or []}:
                raise _bad(f"tool_choice names an unknown function {req.tool_choice.function.name!r}",
                           "tool_choice")
        try:
            thinking = normalize_effort(req.reasoning_effort, medium_effort) is not None
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            prompt = template.render(messages, tools=body.get("tools"), reasoning_effort=req.reasoning_effort,
                                     tool_choice=body.get("tool_choice"), response_format=body.get("response_format"))
        except TemplateError as e:
            raise _bad(str(e), e.param) from None
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = budget(len(prompt), requested, param, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        response_id = "chatcmpl-" + uuid.uuid4().hex
        run = _Run(engine, [(f"{response_id}-{i}", prompt, sampling(req, max_tokens, i, logprobs))
                            for i in range(req.n)])
        tools_on = bool(req.tools) and req.tool_choice != "none"
        choices = [_ChatChoice(i, run, req.stop_list(), OutputParser(tokenizer, thinking), tools_on,
                               req.parallel_tool_calls) for i in range(req.n)]
        now = int(time.time())
        run.start()
        if req.stream:
            await run.admitted(admission_wait)

        def total_usage() -> P.Usage:
            return usage(choices, len(prompt), choices[0].cached_tokens,
                         sum(c.parser.reasoning_tokens for c in choices))

        if not req.stream:
            accs = [ReplyAccumulator() for _ in choices]
            lps: list[list[P.ChatLogprob]] = [[] for _ in choices]

            async def consume() -> None:
                async for i, out in run.events():
                    accs[i].add(choices[i].update(out))
                    if req.logprobs:
                        lps[i] += chat_logprobs(out.logprobs)

            await until_done(request, run, consume)
            result = []
            for c, acc, lp in zip(choices, accs, lps):
                reply = acc.reply(thinking)
                calls = [P.ToolCallOut(id=t.id, function=P.FunctionCallOut(name=t.name, arguments=t.arguments))
                         for t in reply.tool_calls]
                message = P.AssistantMessage(content=reply.content, reasoning_content=reply.reasoning_content,
                                             tool_calls=calls or None)
                result.append(P.ChatChoice(index=c.index, message=message, finish_reason=c.finish_reason or "stop",
                                           logprobs=P.ChoiceLogprobs(content=lp) if req.logprobs else None))
            return P.ChatCompletion(id=response_id, created=now, model=model_name, system_fingerprint=fingerprint,
                                    choices=result, usage=total_usage()).dump()

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choice_list: list[P.ChatChunkChoice], usage_: P.Usage | None = None) -> str:
            return _stream_chunk(P.ChatCompletionChunk, include_usage, id=response_id, created=now, model=model_name,
                                 system_fingerprint=fingerprint, choices=choice_list, usage=usage_)

        async def events() -> AsyncIterator[str]:
            try:
                for c in choices:
                    yield chunk([P.ChatChunkChoice(index=c.index, delta=P.ChatDelta(role="assistant", content=""))])
                async for event in run.events(ping_seconds):
                    if event is _PING:
                        yield ": ping\n\n"
                        continue
                    i, out = event
                    c = choices[i]
                    delta = c.update(out)
                    lp = chat_logprobs(out.logprobs) if req.logprobs else []
                    if delta or lp:
                        calls = [P.ToolCallDeltaOut(index=t.index, id=t.id, type="function" if t.id else None,
                                                    function=P.FunctionCallDelta(name=t.name, arguments=t.arguments))
                                 for t in delta.tool_calls]
                        d = P.ChatDelta(content=delta.content or None, reasoning_content=delta.reasoning or None,
                                        tool_calls=calls or None)
                        yield chunk([P.ChatChunkChoice(index=i, delta=d,
                                                       logprobs=P.ChoiceLogprobs(content=lp) if lp else None)])
                    if c.finish_reason is not None:
                        yield chunk([P.ChatChunkChoice(index=i, delta=P.ChatDelta(), finish_reason=c.finish_reason)])
                if include_usage:
                    yield chunk([], total_usage())
                yield "data: [DONE]\n\n"
            except APIError as e:
                yield _sse(e.body())
            finally:
                run.close()

        return EventStreamResponse(events(), run.close)

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req, _ = await _read_body(request, P.CompletionRequest)
        check_model(req.model)
        if req.suffix:
            raise _bad("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise _bad("best_of must equal n (no server-side ranking)", "best_of")
        raw = req.prompt
        if isinstance(raw, str):
            prompts = [raw]
        elif raw and isinstance(raw[0], int):
            prompts = [raw]
        else:
            prompts = list(raw)
        ids_list, texts = [], []
        for p_index, p in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{p_index}]"
            if isinstance(p, str):
                if not p:
                    raise _bad("the prompt is empty", param)
                ids = [tokenizer.bos_id] + tokenizer.encode(p)
                texts.append(p)
            else:
                if any(t < 0 or t >= tokenizer.vocab_size for t in p):
                    raise _bad(f"token ids must be in [0, {tokenizer.vocab_size})", param)
                ids = list(p)
                texts.append(tokenizer.decode(ids))
            ids_list.append(ids)
        max_tokens = [budget(len(ids), req.max_tokens, "max_tokens", "prompt") for ids in ids_list]
        response_id = "cmpl-" + uuid.uuid4().hex
        items = []
        for p_index, ids in enumerate(ids_list):
            for j in range(req.n):
                k = p_index * req.n + j
                items.append((f"{response_id}-{k}", ids, sampling(req, max_tokens[p_index], j, req.logprobs)))
        run = _Run(engine, items)
        choices = [_TextChoice(k, run, req.stop_list(), tokenizer, texts[k // req.n] if req.echo else "")
                   for k in range(len(items))]
        offsets = [0] * len(items)
        now = int(time.time())
        run.start()
        if req.stream:
            await run.admitted(admission_wait)
        prompt_tokens = sum(len(ids) for ids in ids_list)

        def cached() -> int:
            return sum(choices[p * req.n].cached_tokens for p in range(len(ids_list)))

        def legacy_logprobs(k: int, entries: list[TokenLogprob] | None) -> P.CompletionLogprobs:
            lp = P.CompletionLogprobs(top_logprobs=[] if req.logprobs else None)
            for e in entries or []:
                text, _ = token_text(e.token_id)
                lp.tokens.append(text)
                lp.token_logprobs.append(_finite(e.logprob))
                lp.text_offset.append(offsets[k])
                offsets[k] += len(text)
                if req.logprobs:
                    lp.top_logprobs.append({token_text(t)[0]: _finite(v) for t, v in e.top})
            return lp

        if not req.stream:
            texts_out = [""] * len(items)
            lps = [P.CompletionLogprobs(top_logprobs=[] if req.logprobs else None) for _ in items]

            async def consume() -> None:
                async for k, out in run.events():
                    texts_out[k] += choices[k].update(out)
                    if req.logprobs is not None:
                        more = legacy_logprobs(k, out.logprobs)
                        lps[k].tokens += more.tokens
                        lps[k].token_logprobs += more.token_logprobs
                        lps[k].text_offset += more.text_offset
                        if more.top_logprobs is not None:
                            lps[k].top_logprobs += more.top_logprobs

            await until_done(request, run, consume)
            result = [P.CompletionChoice(index=k, text=texts_out[k], finish_reason=choices[k].finish_reason or "stop",
                                         logprobs=lps[k] if req.logprobs is not None else None)
                      for k in range(len(items))]
            return P.Completion(id=response_id, created=now, model=model_name, system_fingerprint=fingerprint,
                                choices=result, usage=usage(choices, prompt_tokens, cached())).dump()

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choice_list: list[P.CompletionChoice], usage_: P.Usage | None = None) -> str:
            return _stream_chunk(P.Completion, include_usage, id=response_id, created=now, model=model_name,
                                 system_fingerprint=fingerprint, choices=choice_list, usage=usage_)

        async def events() -> AsyncIterator[str]:
            try:
                async for event in run.events(ping_seconds):
                    if event is _PING:
                        yield ": ping\n\n"
                        continue
                    k, out = event
                    text = choices[k].update(out)
                    lp = legacy_logprobs(k, out.logprobs) if req.logprobs is not None else None
                    if text or lp is not None:
                        yield chunk([P.CompletionChoice(index=k, text=text, logprobs=lp)])
                    if choices[k].finish_reason is not None:
                        yield chunk([P.CompletionChoice(index=k, text="", finish_reason=choices[k].finish_reason)])
                if include_usage:
                    yield chunk([], usage(choices, prompt_tokens, cached()))
                yield "data: [DONE]\n\n"
            except APIError as e:
                yield _sse(e.body())
            finally:
                run.close()

        return EventStreamResponse(events(), run.close)

    return app
