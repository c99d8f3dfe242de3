"""The HTTP API beyond the SDK: k3's client (fork, snapshots, restore, exec), clear errors for bad input, and
a manager that keeps serving after each of them."""

from __future__ import annotations

import json
import struct
import time

import httpx
import pytest

from k3.sandbox.client import SandboxAPIError


def test_client_fork_snapshot_restore(client):
    sbx = client.create(timeout=120)
    try:
        sbx.write_file("/home/user/code.py", "print(6 * 7)\n")
        assert sbx.exec("python3 code.py").stdout == "42\n"
        snap = sbx.snapshot()
        h = sbx.tree_hash()
        sbx.exec("rm code.py; echo junk > junk")
        kids = sbx.fork(4)
        assert [k.exec("ls ~").stdout for k in kids] == ["junk\n"] * 4
        kids[0].exec("echo only-here > ~/mine")
        assert "mine" not in kids[1].exec("ls ~").stdout
        sbx.restore(snap)
        assert sbx.tree_hash() == h
        assert [s["snapshotID"] for s in sbx.snapshots()] == [snap]
        assert snap in [s["snapshotID"] for s in client.snapshots()]
        from_snap = client.create(template=snap)
        assert from_snap.exec("python3 code.py").stdout == "42\n"
        for k in kids + [from_snap]:
            assert k.kill()
        client.delete_snapshot(snap)
        with pytest.raises(SandboxAPIError, match="404"):
            client.create(template=snap)
    finally:
        sbx.kill()


def test_bad_ids_and_templates(client, server):
    h = {"X-API-Key": "test-key"}
    for method, path, body in [("GET", "/sandboxes/inope", None), ("DELETE", "/sandboxes/inope", None),
                               ("POST", "/sandboxes/inope/pause", None), ("POST", "/sandboxes/inope/fork", {}),
                               ("POST", "/v2/sandboxes/inope/connect", {}),
                               ("POST", "/sandboxes/inope/snapshots", None),
                               ("POST", "/v2/sandboxes", {"templateID": "nope"}),
                               ("POST", "/v2/sandboxes", {"templateID": "../../etc"}),
                               ("DELETE", "/snapshots/nope", None)]:
        r = httpx.request(method, server + path, json=body, headers=h)
        assert r.status_code == 404 and set(r.json()) == {"code", "message"}, (path, r.text)
    r = httpx.post(server + "/v2/sandboxes", json={"templateID": 5, "timeout": -1}, headers=h)
    assert r.status_code == 400 and r.json()["code"] == 400
    r = httpx.post(server + "/v2/sandboxes", json={"allow_internet_access": True}, headers=h)
    assert r.status_code == 400 and "loopback" in r.json()["message"]
    assert httpx.get(server + "/v2/sandboxes").status_code == 401  # no key
    data = {"E2b-Sandbox-Id": "inope", "X-Access-Token": "t"}
    r = httpx.get(server + "/files", params={"path": "/etc/hostname"}, headers=data)
    assert r.status_code == 502 and "was not found" in r.json()["message"]
    sbx = client.create()
    try:
        r = httpx.get(server + "/files", params={"path": "/etc/hostname"},
                      headers={"E2b-Sandbox-Id": sbx.id, "X-Access-Token": "wrong"})
        assert r.status_code == 401
        r = httpx.post(server + "/filesystem.Filesystem/Watch", json={}, headers=sbx._envd_headers())
        assert r.status_code == 404 and r.json()["code"] == "unimplemented"
    finally:
        sbx.kill()
    assert "/v2/sandboxes" in httpx.get(server + "/openapi.json").json()["paths"]


def test_oversized_files(client, manager):
    sbx = client.create()
    try:
        limit = manager.config.max_file_bytes
        with pytest.raises(SandboxAPIError, match="413"):
            sbx.write_file("/tmp/big", b"x" * (limit + 1))
        sbx.exec(f"head -c {limit + 1} /dev/zero > /tmp/big")
        with pytest.raises(SandboxAPIError, match="413"):
            sbx.read_file("/tmp/big")
        with pytest.raises(SandboxAPIError, match="400"):
            sbx.read_file("/tmp")
        assert sbx.exec("echo still serving").stdout == "still serving\n"
    finally:
        sbx.kill()


def _connect_start(server, sbx, cmd: str) -> list[dict]:
    msg = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}}).encode()
    r = httpx.post(server + "/process.Process/Start", content=struct.pack(">BI", 0, len(msg)) + msg,
                   headers=sbx._envd_headers() | {"Content-Type": "application/connect+json",
                                                  "Connect-Timeout-Ms": "60000"}, timeout=120)
    assert r.headers["content-type"] == "application/connect+json"
    out, raw = [], r.content
    while raw:
        flags, n = struct.unpack(">BI", raw[:5])
        out.append({"flags": flags, **json.loads(raw[5:5 + n])})
        raw = raw[5 + n:]
    return out


def test_huge_output_is_cut_and_the_server_keeps_serving(client, server, manager):
    sbx = client.create()
    try:
        t = time.monotonic()
        r = sbx.exec("head -c 100000000 /dev/zero; echo never")
        assert r.error == "output limit" and r.exit_code == 137
        assert len(r.stdout) <= manager.config.max_output_bytes and "never" not in r.stdout
        events = _connect_start(server, sbx, "head -c 100000000 /dev/urandom")
        assert events[0]["event"]["start"]["pid"] > 0
        assert events[-2]["event"]["end"] == {"exitCode": -1, "exited": False, "status": "signal: killed",
                                              "error": "output limit"}
        assert events[-1] == {"flags": 2}
        assert time.monotonic() - t < 30
        assert sbx.exec("echo fine").stdout == "fine\n"
        assert httpx.get(server + "/health").json()["status"] == "ok"
    finally:
        sbx.kill()


def test_raw_connect_stream_carries_exact_bytes(client, server):
    import base64

    sbx = client.create()
    try:
        events = _connect_start(server, sbx, r"printf '\xff\x00\xc3'; exit 4")
        data = b"".join(base64.b64decode(e["event"]["data"]["stdout"]) for e in events if "data" in e.get("event", {}))
        assert data == b"\xff\x00\xc3"
        assert events[-2]["event"]["end"]["exitCode"] == 4
        bad = _connect_start(server, sbx, "true")  # a good one still works after it
        assert bad[-2]["event"]["end"] == {"exitCode": 0, "exited": True, "status": "exit status 0"}
    finally:
        sbx.kill()
