"""Fixtures for the server tests: the debug preset with random weights (the 512-token BPE `tokenizer` is in
tests/conftest.py), and a real uvicorn server on a free loopback port (in a thread of this process)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from k3.config import get_preset
from k3.model.model import build_model

MODEL_NAME = "k3-debug"


@pytest.fixture(scope="session")
def model():
    torch.manual_seed(0)
    config = get_preset("debug")
    assert config.vocab_size == 512
    return build_model(config, seed=0).eval()


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, app):
        import uvicorn

        # IPPROTO_TCP named: asyncio turns Nagle off only for sockets that say they are TCP (40 ms per reply else)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def real_engine_available() -> bool:
    try:
        from k3.infer.engine import AsyncEngine  # noqa: F401
    except ImportError:
        return False
    return True


def make_engine(model, tokenizer, **config):
    """The real `AsyncEngine` (context 1024 tokens), or the fake where `k3.infer.engine` cannot be imported."""
    if not real_engine_available():
        from tests.serve.fake_engine import FakeEngine

        return FakeEngine(model, tokenizer.vocab_size)
    from k3.infer.config import EngineConfig
    from k3.infer.engine import AsyncEngine, Engine

    config.setdefault("max_context", 1024)
    return AsyncEngine(Engine(model, EngineConfig(**config)))


def serve(engine, tokenizer, **kwargs):
    from k3.serve.app import create_app

    if not hasattr(engine, "max_context"):
        kwargs.setdefault("max_context", 1024)
    return LiveServer(create_app(engine, tokenizer, MODEL_NAME, **kwargs))


@pytest.fixture(scope="module")
def fake(model, tokenizer):
    """A server over the scriptable fake engine: (engine, base_url)."""
    from tests.serve.fake_engine import FakeEngine

    engine = FakeEngine(model, tokenizer.vocab_size)
    with serve(engine, tokenizer) as server:
        yield engine, server.base_url


@pytest.fixture(scope="module")
def live(model, tokenizer):
    """A server over the engine the product ships (see `make_engine`): (engine, base_url)."""
    engine = make_engine(model, tokenizer)
    try:
        with serve(engine, tokenizer) as server:
            yield engine, server.base_url
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
