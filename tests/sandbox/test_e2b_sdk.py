"""The official `e2b` SDK, unmodified, against `k3 sandbox serve` on loopback (pointed at it with
E2B_API_URL and E2B_SANDBOX_URL): every call docs/sandbox.md lists as served, sync and async, and its error mapping."""

from __future__ import annotations

import asyncio
import time

import pytest

e2b = pytest.importorskip("e2b", reason="the e2b SDK is not installed (test extra)")


@pytest.fixture
def sdk(server, monkeypatch):
    monkeypatch.setenv("E2B_API_KEY", "test-key")
    monkeypatch.setenv("E2B_API_URL", server)
    monkeypatch.setenv("E2B_SANDBOX_URL", server)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    made = []

    def create(**kwargs):
        s = e2b.Sandbox.create(**kwargs)
        made.append(s)
        return s

    yield create
    for s in made:
        s.kill()


def test_create_run_kill(sdk, manager):
    sbx = sdk(timeout=120, metadata={"task": "t1"}, envs={"FOO": "bar"})
    assert manager.get(sbx.sandbox_id).metadata == {"task": "t1"}
    r = sbx.commands.run("echo hi $FOO; echo oops >&2; id -un; pwd")
    assert (r.stdout, r.stderr, r.exit_code) == ("hi bar\nuser\n/home/user\n", "oops\n", 0)
    r = sbx.commands.run("echo $X; cd .. && pwd", envs={"X": "cmd"}, cwd="/tmp")
    assert r.stdout == "cmd\n/\n"
    with pytest.raises(e2b.CommandExitException) as exc:
        sbx.commands.run("echo partial; exit 3")
    assert exc.value.exit_code == 3 and exc.value.stdout == "partial\n"
    assert sbx.kill() is True
    assert sbx.sandbox_id not in manager.sandboxes
    assert e2b.Sandbox.kill(sbx.sandbox_id) is False
    with pytest.raises(e2b.SandboxException):  # SandboxNotRunningException: the data plane answers 502
        sbx.commands.run("true")


def test_streaming_background_and_timeouts(sdk):
    sbx = sdk()
    lines = []
    r = sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done", on_stdout=lines.append)
    assert lines == ["1\n", "2\n", "3\n"] and r.exit_code == 0
    h = sbx.commands.run("sleep 30", background=True)
    assert [p.pid for p in sbx.commands.list()] == [h.pid]
    assert h.kill() is True
    t = time.monotonic()
    with pytest.raises(e2b.TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - t < 10
    assert sbx.commands.kill(999999) is False


def test_stdin(sdk):
    sbx = sdk()
    h = sbx.commands.run("cat; echo done", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "typed\n")
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "typed\ndone\n"


def test_binary_and_invalid_utf8_output(sdk):
    sbx = sdk()
    r = sbx.commands.run(r"printf 'ok \xff\xfe\x00 \xc3\xa9 end'")
    assert r.stdout.startswith("ok ") and r.stdout.endswith(" é end")


def test_files(sdk):
    sbx = sdk()
    info = sbx.files.write("/home/user/dir/a.txt", "hello")
    assert (info.name, info.path) == ("a.txt", "/home/user/dir/a.txt")
    assert sbx.files.read("/home/user/dir/a.txt") == "hello"
    assert sbx.files.read("dir/a.txt") == "hello"  # relative to the user's home
    blob = bytes(range(256)) * 10
    sbx.files.write("/tmp/blob.bin", blob)
    assert bytes(sbx.files.read("/tmp/blob.bin", format="bytes")) == blob
    assert sbx.commands.run("sha256sum /tmp/blob.bin | cut -c1-8").stdout.strip() == \
        __import__("hashlib").sha256(blob).hexdigest()[:8]
    entries = sbx.files.list("/home/user/dir")
    assert [(e.name, e.type.value, e.size, e.owner) for e in entries] == [("a.txt", "file", 5, "user")]
    assert sbx.files.exists("/home/user/dir/a.txt") and not sbx.files.exists("/nope")
    assert sbx.files.make_dir("/home/user/x/y") is True and sbx.files.make_dir("/home/user/x/y") is False
    sbx.files.rename("/home/user/dir/a.txt", "/home/user/x/b.txt")
    assert sbx.commands.run("cat ~/x/b.txt").stdout == "hello"
    sbx.files.remove("/home/user/x")
    assert not sbx.files.exists("/home/user/x")
    with pytest.raises(e2b.FileNotFoundException):
        sbx.files.read("/home/user/missing")
    import io
    sbx.files.write("/tmp/stream.txt", io.BytesIO(b"from a file object"))  # the octet-stream upload
    assert sbx.files.read("/tmp/stream.txt") == "from a file object"


def test_set_timeout_info_list(sdk, manager):
    sbx = sdk(metadata={"k": "v w"})
    sbx.set_timeout(600)
    assert manager.get(sbx.sandbox_id).end_at > time.time() + 590
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id and info.metadata == {"k": "v w"} and info.state.value == "running"
    listed = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"k": "v w"})).next_items()
    assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]


@pytest.mark.cgroups
def test_pause_connect(sdk, manager):
    sbx = sdk()
    sbx.files.write("/home/user/state", "before pause")
    assert sbx.pause() is True
    assert manager.get(sbx.sandbox_id).state == "paused"
    assert sbx.is_running() is False
    assert sbx.pause() is False  # already paused: 409
    again = e2b.Sandbox.connect(sbx.sandbox_id)
    assert manager.get(sbx.sandbox_id).state == "running"
    assert again.files.read("/home/user/state") == "before pause"
    assert again.commands.run("echo resumed").stdout == "resumed\n"


def test_errors_map_to_sdk_exceptions(sdk, monkeypatch):
    with pytest.raises(e2b.SandboxException, match="404"):
        sdk(template="no-such-template")
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.connect("inosuchsandbox")
    monkeypatch.setenv("E2B_API_KEY", "wrong")
    with pytest.raises(e2b.AuthenticationException):
        e2b.Sandbox.create()


def test_async_sdk(server, monkeypatch):
    monkeypatch.setenv("E2B_API_KEY", "test-key")
    monkeypatch.setenv("E2B_API_URL", server)
    monkeypatch.setenv("E2B_SANDBOX_URL", server)

    async def main():
        sbx = await e2b.AsyncSandbox.create()
        try:
            r = await sbx.commands.run("echo async")
            await sbx.files.write("/tmp/a", "x")
            return r.stdout, await sbx.files.read("/tmp/a")
        finally:
            await sbx.kill()

    assert asyncio.run(main()) == ("async\n", "x")
