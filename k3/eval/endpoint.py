"""What `k3 eval MODEL` talks to: MODEL is a served URL, a run folder, a checkpoint folder, or `preset:NAME`
(random weights and the byte tokenizer: smoke tests). Every evaluation goes through the OpenAI-compatible
server, so a local model is served first: `k3 serve`'s app (`k3.serve.app.create_app`) over the inference engine
under uvicorn, on a free loopback port, in a thread of this process. The tools the field uses (lm-evaluation-
harness) and k3's own evaluations then see the same endpoints a remote server has.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from k3.eval.client import Client


@dataclass
class Endpoint:
    """A reachable server: its root URL, the served model's name and context, and (for a local model) the
    tokenizer and model, which k3's in-process reference scoring uses."""

    url: str
    model_name: str
    max_context: int
    api_key: str | None = None
    tokenizer: Any = None
    model: Any = None

    def client(self, timeout: float = 600.0) -> Client:
        return Client(self.url, self.api_key, timeout)


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def load_local(spec: str, device: str = "cpu"):
    """(model, tokenizer, name) of a run folder, checkpoint folder or `preset:NAME`."""
    if spec.startswith("preset:"):
        from k3.config import get_preset
        from k3.model.model import build_model
        from k3.tokenizer import byte_tokenizer

        config = get_preset(spec[len("preset:"):])
        model = build_model(config, seed=0, device=device).eval()
        return model, byte_tokenizer(config.vocab_size), f"k3-{spec[len('preset:'):]}"
    from k3.checkpoint import load_trained

    path = Path(spec)
    if not path.exists():
        raise ValueError(f"{spec} is neither a URL (http://…), a run or checkpoint folder, nor preset:NAME")
    model, tokenizer, _ = load_trained(path, device=device)
    return model, tokenizer, path.resolve().name


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread (a context manager)."""

    def __init__(self, app: Any):
        import uvicorn

        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so, and without it every reply on a
        # kept-alive connection (lm-eval's) waits ~40 ms for the client's delayed ACK (Nagle)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="k3-eval-server")

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the evaluation server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@contextlib.contextmanager
def open_endpoint(spec: str, api_key: str | None = None, device: str = "cpu",
                  engine_options: dict[str, Any] | None = None) -> Iterator[Endpoint]:
    """An `Endpoint` for MODEL: the URL as given, or a local model served for the duration of the block.
    `engine_options`: `k3.infer.config.EngineConfig` fields for a local model (e.g. `max_context`)."""
    if is_url(spec):
        client = Client(spec, api_key)
        card = client.model()
        yield Endpoint(client.base_url, card["id"], int(card.get("max_model_len") or 0), api_key)
        return
    model, tokenizer, name = load_local(spec, device)
    with serve_local(model, tokenizer, name, engine_options) as endpoint:
        yield endpoint


@contextlib.contextmanager
def serve_local(model: Any, tokenizer: Any, name: str,
                engine_options: dict[str, Any] | None = None) -> Iterator[Endpoint]:
    """Serve `model` (a `K3ForCausalLM`) with `k3 serve`'s app on a free loopback port for the block."""
    from k3.infer.config import EngineConfig
    from k3.infer.engine import AsyncEngine, Engine
    from k3.serve.app import create_app

    engine = AsyncEngine(Engine(model, EngineConfig(**(engine_options or {}))))
    try:
        app = create_app(engine, tokenizer, name, default_max_tokens=4096)
        with ServerThread(app) as server:
            yield Endpoint(server.url, name, engine.max_context, None, tokenizer, model)
    finally:
        engine.shutdown()
