"""OpenAI error bodies `{"error": {message, type, param, code}}`, and which HTTP error an engine exception is.

Bad input is always a 4xx naming the offending `param`; `AdmissionError` becomes 429/503 with `Retry-After`
(seconds) and `retry-after-ms`, which the `openai` client honours; anything else is a 500 the client must
not retry.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi.responses import JSONResponse

from k3.infer.api import AdmissionError, ContextLengthError
from k3.serve import protocol as P


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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_error(e: BaseException) -> APIError:
    """An exception from the engine → the error the client gets."""
    if isinstance(e, AdmissionError):
        retry = max(0.0, float(e.retry_after))
        headers = {"Retry-After": str(max(1, math.ceil(retry))), "retry-after-ms": str(int(retry * 1000))}
        if e.status == 429:
            return APIError(429, str(e), "rate_limit_error", code="rate_limit_exceeded", headers=headers)
        return APIError(503, str(e), "overloaded_error", code="overloaded", headers=headers)
    if isinstance(e, ContextLengthError):
        return bad_request(str(e), "messages", "context_length_exceeded")
    if isinstance(e, ValueError):
        return bad_request(str(e))
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error",
                    headers={"x-should-retry": "false"})
