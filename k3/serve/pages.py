"""The web chat page (`GET /`), the live dashboard (`GET /dashboard`), their static files, and the two small JSON
endpoints they read: `GET /ui/info` (what the page must know before it talks to `/v1`) and `GET /ui/metrics`
(the engine's metrics snapshot as flat JSON numbers, polled by the dashboard every second).

The pages are plain HTML, CSS and ES modules in `k3/serve/static/`, shipped inside the package: no CDN, no
build step, no network at run time. Every URL in them is relative (the modules find the app's root from their
own URL), so the pages work behind a reverse proxy or a mount at any path prefix. Like `/metrics` and `/health`,
the pages and `/ui/*` need no API key; the page asks for one when `/ui/info` says the server has one.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from fastapi import Request
from fastapi.responses import FileResponse

from k3.serve.errors import APIError
from k3.serve.state import AppState

STATIC = Path(__file__).parent / "static"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
               ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
# the pages run only their own modules and talk only to this server; rendered markdown cannot add scripts
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'self'")
# the engine takes token ids of text: the chat template refuses image parts, so the page must not offer them
VISION_NOTE = ("This model reads text only: the server has no vision tower wired into its engine, "
               "so images cannot be attached.")
REASONING_EFFORTS = ["low", "high", "max"]  # the trained levels (docs/serving.md, "Modes")


def _file(name: str) -> FileResponse:
    path = STATIC / name
    # a flat folder: only names listed in it are served (no path segments, no dot files)
    if "/" in name or name.startswith(".") or not path.is_file() or path.suffix not in MEDIA_TYPES:
        raise APIError(404, f"no static file {name!r}", "not_found_error")
    headers = {"Cache-Control": "no-cache"}
    if path.suffix == ".html":
        headers["Content-Security-Policy"] = CSP
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=headers)


async def chat_page():
    return _file("chat.html")


async def dashboard_page():
    return _file("dashboard.html")


async def static_file(name: str):
    return _file(name)


async def info(request: Request):
    """What the page needs before it calls `/v1` (no key needed): whether it must ask for a key, whether images
    can be attached (and why not), the reasoning efforts to offer."""
    state: AppState = request.app.state.k3
    return {"api_key_required": state.api_key is not None, "vision": False, "vision_note": VISION_NOTE,
            "reasoning_efforts": REASONING_EFFORTS}


def flat_metrics(snapshot: dict) -> dict[str, float]:
    """An engine metrics snapshot → {name: number}: gauges and counters as they are, a histogram as its
    `<name>_sum` and `<name>_count` (the buckets stay on `/metrics`); non-finite values left out (not JSON)."""
    out: dict[str, float] = {}
    for name, value in snapshot.items():
        if isinstance(value, dict):
            out[f"{name}_sum"], out[f"{name}_count"] = float(value["sum"]), int(value["count"])
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = value
    return out


async def metrics_json(request: Request):
    """`{"time": unix seconds, "metrics": {name: number}}`: the names of `/metrics` without the `k3_` prefix.
    Speculative decoding, when an engine has it, reports `spec_draft_tokens_total` and
    `spec_accepted_tokens_total`; the dashboard shows "not enabled" without them."""
    engine = request.app.state.k3.engine
    return {"time": time.time(), "metrics": flat_metrics(engine.metrics())}


ROUTES = [
    ("GET", "/", chat_page),
    ("GET", "/dashboard", dashboard_page),
    ("GET", "/static/{name}", static_file),
    ("GET", "/ui/info", info),
    ("GET", "/ui/metrics", metrics_json),
]
