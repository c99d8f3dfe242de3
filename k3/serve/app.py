"""The OpenAI-compatible HTTP server: a FastAPI app over the inference engine (docs/serving.md).

`create_app(engine, tokenizer, model_name)` serves `POST /v1/chat/completions`, `POST /v1/completions`,
`POST /v1/responses` and `GET /v1/responses/{id}` (`responses.py`),
`GET /v1/models`, `GET /health` and `GET /metrics`, vLLM's `POST /tokenize`, `POST /detokenize` and
`GET /tokenizer_info` (what evaluation harnesses tokenize with), and (`pages.py`) the chat page at `/`, the dashboard at
`/dashboard` and the JSON they read under `/ui/`. The app talks to the engine only through its
token-level API (`k3.infer.api`): it renders chats with `ChatTemplate`, submits token ids with
`SamplingParams`, and turns the `RequestOutput` stream back into OpenAI responses or SSE chunks.

The pieces: `state.py` (`AppState`: the engine, tokenizer, template, model name and options), `validate.py`
(request bodies and fields → 4xx naming the `param`), `handlers.py` (one handler per endpoint), `stream.py`
(the one response path, JSON or SSE, shared by the generating endpoints), `errors.py` (OpenAI error bodies).
Text is `k3.chat`'s: stop strings are matched on the visible text (the reply's `content` for chats, the text
for completions) and a match aborts the engine request; the engine gets only the stop token ids
(`<|end_of_msg|>`, `[EOS]`). Every response carries `x-request-id`.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.infer.score import scorer_for
from k3.serve import handlers, pages, responses
from k3.serve.errors import APIError, engine_error
from k3.serve.state import ADMISSION_WAIT_SECONDS, MAX_REQUEST_BYTES, PING_SECONDS, AppState
from k3.tokenizer import Tokenizer

log = logging.getLogger("k3.serve")

ROUTES = [
    ("GET", "/health", handlers.health),
    ("GET", "/metrics", handlers.metrics),
    ("GET", "/v1/models", handlers.list_models),
    ("GET", "/v1/models/{name:path}", handlers.get_model),
    ("POST", "/v1/chat/completions", handlers.chat_completions),
    ("POST", "/v1/completions", handlers.completions),
    ("POST", "/tokenize", handlers.tokenize),
    ("POST", "/detokenize", handlers.detokenize),
    ("GET", "/tokenizer_info", handlers.tokenizer_info),
    ("POST", "/v1/responses", responses.create_response),
    ("GET", "/v1/responses/{response_id}", responses.get_response),
]


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
            response = engine_error(e).response()
            await response(scope, receive, send_with_id)


async def _api_error(request: Request, e: APIError):
    return e.response()


async def _http_error(request: Request, e: StarletteHTTPException):
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
    return APIError(e.status_code, str(e.detail), kind).response()


def image_policy(engine: Any, tokenizer: Tokenizer, allow_local_images: bool) -> Any:
    """The `k3.vision.chat.ImagePolicy` of a multimodal engine, None for a text-only one. ValueError when the
    model's media pad is not the tokenizer's `<|media_pad|>` (its images would never line up)."""
    if not getattr(engine, "accepts_media", False):
        return None
    from k3.vision.chat import ImagePolicy

    pad = tokenizer.special_id("<|media_pad|>")
    if pad != engine.media_pad_id:
        raise ValueError(f"the model's media_placeholder_token_id is {engine.media_pad_id} but the tokenizer's "
                         f"<|media_pad|> is {pad}: serve the model with the tokenizer it was trained with")
    return ImagePolicy(allow_local_files=allow_local_images)


def create_app(engine: Any, tokenizer: Tokenizer, model_name: str, api_key: str | None = None,
               max_context: int | None = None, *, default_max_tokens: int | None = None, medium_effort: str = "high",
               ping_seconds: float = PING_SECONDS, admission_wait: float = ADMISSION_WAIT_SECONDS,
               max_request_bytes: int = MAX_REQUEST_BYTES, scorer: Any = None,
               allow_local_images: bool = False) -> FastAPI:
    """The OpenAI-compatible app over `engine` (a `k3.infer.engine.AsyncEngine` or anything with its
    `stream` / `abort` / `metrics`).

    `max_context`: prompt + completion tokens per request (default: the engine's `max_context`);
    `default_max_tokens`: completion budget when a request sets none (default: the rest of the context);
    `api_key`: when set, `/v1/*` needs `Authorization: Bearer <api_key>`; `max_request_bytes`: larger bodies get 413;
    `scorer`: scores prompts for echo with logprobs (default: `k3.infer.score.scorer_for(engine)`, the engine's
    model under the engine's lock); `allow_local_images`: `image_url` parts may name files on this machine (else
    only base64 data URLs; a multimodal engine only, see docs/vision.md).
    The app does not own the engine: whoever built it shuts it down (`k3 serve` does, after uvicorn exits).
    """
    if max_context is None:
        max_context = int(getattr(engine, "max_context", 4096))
    if scorer is None:
        scorer = scorer_for(engine)
    app = FastAPI(title="k3", docs_url=None, redoc_url=None)
    app.add_middleware(_RequestIdMiddleware)
    app.state.engine = engine
    app.state.k3 = AppState(engine, tokenizer, model_name, max_context, api_key=api_key,
                            default_max_tokens=default_max_tokens, medium_effort=medium_effort,
                            ping_seconds=ping_seconds, admission_wait=admission_wait,
                            max_request_bytes=max_request_bytes, scorer=scorer)
    # a multimodal engine takes image_url parts (k3.vision.chat renders them); None: a text-only model, whose
    # image parts are 400s
    app.state.k3.images = image_policy(engine, tokenizer, allow_local_images)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for method, path, handler in ROUTES + pages.ROUTES:
        app.add_api_route(path, handler, methods=[method])
    return app
