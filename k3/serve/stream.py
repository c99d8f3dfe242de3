"""One response path for every generating endpoint: `respond` answers the engine requests of one API call as one
JSON body or as server-sent events, whatever the endpoint; the endpoint gives its `Choice`s.

- **n > 1** is n engine requests (ids `<response id>-<i>`), merged into one queue by `Run`.
- **Streams** send each choice's pieces as they come, then the choice's `finish_reason` chunk; with
  `include_usage` a last chunk with the usage; then `data: [DONE]`. A stream checks admission before
  sending its headers, so a refused request is a status code, not an SSE error; a later failure is one
  `data: {"error": …}` event. `: ping` comments keep a waiting stream open.
- **Disconnects**: a streaming response listens for the client going away and aborts its engine requests
  at once, even mid-prefill; a non-streaming one polls for it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from k3.infer.api import RequestOutput, SamplingParams
from k3.serve import protocol as P
from k3.serve.errors import APIError, engine_error
from k3.serve.state import AppState

DISCONNECT_POLL_SECONDS = 0.5
PING = object()


class Run:
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
        if not self.items:  # nothing to generate (a prompt that is only scored)
            return
        try:
            self._held.append(await asyncio.wait_for(self.queue.get(), wait))
        except asyncio.TimeoutError:
            pass
        while not self.queue.empty():
            self._held.append(self.queue.get_nowait())
        for _, item in self._held:
            if isinstance(item, BaseException):
                self.close()
                raise engine_error(item)

    async def events(self, ping: float | None = None) -> AsyncIterator[Any]:
        """Yield (i, RequestOutput) until every choice is done; `PING` after `ping` idle seconds; raise errors."""
        while not all(self.done):
            if self._held:
                i, item = self._held.pop(0)
            else:
                try:
                    i, item = await asyncio.wait_for(self.queue.get(), ping)
                except asyncio.TimeoutError:
                    yield PING
                    continue
            if self.done[i]:
                continue
            if isinstance(item, BaseException):
                raise engine_error(item)
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


class Choice:
    """One choice of a response, fed its engine request's outputs. An endpoint's subclass implements `update`
    (account one output; return the piece to stream, or None), `finish_piece` and `result`."""

    def __init__(self, index: int, run: Run):
        self.index = index
        self.run = run
        self.token_ids: list[int] = []
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.accepted_prediction_tokens = self.rejected_prediction_tokens = 0
        self.finish_reason: str | None = None

    def account(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens, len(self.token_ids))
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        self.accepted_prediction_tokens = max(self.accepted_prediction_tokens, out.accepted_prediction_tokens)
        self.rejected_prediction_tokens = max(self.rejected_prediction_tokens, out.rejected_prediction_tokens)

    def finish(self, reason: str) -> None:
        """The choice is over (the engine finished it, or a stop string matched: then its request is aborted)."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.run.finish(self.index)

    def update(self, out: RequestOutput) -> Any:
        raise NotImplementedError

    def finish_piece(self) -> Any:
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError


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


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def until_done(request: Request, run: Run, consume: Callable[[], Any]) -> None:
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


async def respond(request: Request, state: AppState, req: P._Sampling, run: Run, choices: Sequence[Choice], *,
                  header: dict[str, Any], response_model: type[P._Response], chunk_model: type[P._Response],
                  usage: Callable[[], P.Usage], opening: Sequence[Any] = ()) -> Any:
    """Start `run` and answer it: `response_model(**header, choices=[c.result()], usage=usage())` as JSON, or
    (`req.stream`) the chunks `chunk_model(**header, choices=[piece])` as SSE, `opening` pieces first."""
    run.start()
    if not req.stream:
        async def consume() -> None:
            async for i, out in run.events():
                choices[i].update(out)

        await until_done(request, run, consume)
        return response_model(**header, choices=[c.result() for c in choices], usage=usage()).dump()

    await run.admitted(state.admission_wait)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(pieces: list[Any], usage_: P.Usage | None = None) -> str:
        c = chunk_model(**header, choices=pieces, usage=usage_).dump()
        if not include_usage:  # `usage` appears only when the client asked for it
            del c["usage"]
        return sse(c)

    async def events() -> AsyncIterator[str]:
        try:
            for piece in opening:
                yield chunk([piece])
            async for event in run.events(state.ping_seconds):
                if event is PING:
                    yield ": ping\n\n"
                    continue
                i, out = event
                piece = choices[i].update(out)
                if piece is not None:
                    yield chunk([piece])
                if choices[i].finish_reason is not None:
                    yield chunk([choices[i].finish_piece()])
            if include_usage:
                yield chunk([], usage())
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield sse(e.body())
        finally:
            run.close()

    return EventStreamResponse(events(), run.close)
