"""Fixtures for the sandbox tests: one manager (and its base template) per session, a sandbox per test, and the
HTTP server on loopback. Everything that needs a sandbox skips with the failing probe's reason on a host without
bubblewrap, user namespaces or overlayfs; tests that need limits or pause also skip without writable cgroups."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from k3.sandbox import probe

BASE_PROBES = ("bwrap", "overlay")


def _skip_reason(*names: str) -> str | None:
    for name in names:
        p = getattr(probe, name)()
        if not p:
            return f"{name}: {p.reason}"
    return None


def _needs_sandboxes(item) -> bool:
    # test_programs.py runs each test on both program runners: the subprocess one needs no sandbox
    callspec = getattr(item, "callspec", None)
    return callspec is None or callspec.params.get("runner") != "subprocess"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/sandbox/" not in str(item.fspath).replace(os.sep, "/") or not _needs_sandboxes(item):
            continue
        reason = _skip_reason(*BASE_PROBES)
        if reason is None and "cgroups" in item.keywords:
            reason = _skip_reason("cgroups")
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_configure(config):
    config.addinivalue_line("markers", "cgroups: needs writable cgroups (memory, pids, cpu, freezer)")


@pytest.fixture(scope="session")
def state_dir():
    """Outside pytest's 0700 temp folders: sandboxes run as another uid and must reach their root."""
    path = Path(tempfile.mkdtemp(prefix="k3-sandbox-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def manager(state_dir):
    from k3.sandbox import Manager, SandboxConfig

    m = Manager(SandboxConfig(state_dir=state_dir, memory_mb=256, pids=128, max_output_bytes=4 << 20,
                              max_file_bytes=8 << 20))
    m.ensure_template("base")
    yield m
    m.close(kill_all=True)


@pytest.fixture
def sbx(manager):
    s = manager.create()
    yield s
    if s.id in manager.sandboxes:
        manager.kill(s.id)


def copy_templates(manager, dest):
    """A second state folder sharing the session's templates (hard links: no rebuild)."""
    subprocess.run(["cp", "-al", str(manager.dir / "templates"), str(dest / "templates")], check=True)


@pytest.fixture
def fresh_state(manager):
    """An empty state folder with the session's templates, for a second manager."""
    from k3.sandbox import Manager, SandboxConfig

    folder = Path(tempfile.mkdtemp(prefix="k3-sandbox-test-"))
    copy_templates(manager, folder)
    yield folder
    Manager(SandboxConfig(state_dir=folder)).close(kill_all=True)  # what a failed test left
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def server(manager):
    """The API on a free loopback port, served from a thread: yields its base URL."""
    import uvicorn

    from k3.sandbox.server import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(manager, api_key="test-key", reap_every=0.2), host="127.0.0.1",
                                        port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


@pytest.fixture
def client(server):
    from k3.sandbox.client import Client

    c = Client(server, api_key="test-key")
    yield c
    c.close()
