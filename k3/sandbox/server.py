"""The HTTP API (FastAPI): E2B's control plane and envd's data plane on one port, plus AgentENV's fork/snapshots.

Control plane (REST + JSON, `X-API-Key`; errors `{"code": <int>, "message": <str>}` as the SDK parses them):
`POST /v2/sandboxes` (and `/sandboxes`), `GET /v2/sandboxes`, `GET|DELETE /sandboxes/{id}`,
`POST /sandboxes/{id}/pause|connect|timeout`; k3's `POST /sandboxes/{id}/fork|snapshots|restore|exec`,
`GET /sandboxes/{id}/snapshots`, `GET /snapshots`, `DELETE /snapshots/{id}`, `GET /templates`.

Data plane (what the `e2b` SDK sends to envd; every request names its sandbox in `E2b-Sandbox-Id` and proves
it with `X-Access-Token`): `GET /health`, `GET|POST /files`, and the Connect-protocol (JSON codec) services
`process.Process` (`Start` streamed, `SendSignal`, `List`, `SendInput`, `CloseStdin`) and
`filesystem.Filesystem` (`Stat`, `ListDir`, `MakeDir`, `Remove`, `Move`). A paused, killed or unknown sandbox
answers 502 "The sandbox <id> was not found", which the SDK maps to `SandboxNotRunningException`.

Point the SDK here with `E2B_API_URL=http://HOST:PORT` and `E2B_SANDBOX_URL=http://HOST:PORT`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import stat
import struct
import threading
from datetime import UTC, datetime
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from k3.sandbox.fs import sandbox_path
from k3.sandbox.manager import Manager, NotFound, NotRunning, Sandbox, SandboxError

ENVD_VERSION = "0.5.7"  # the highest envd feature level served (octet-stream uploads; no metadata, no watch)
CONNECT_STATUS = {"invalid_argument": 400, "unauthenticated": 401, "permission_denied": 403, "not_found": 404,
                  "already_exists": 409, "resource_exhausted": 429, "internal": 500, "unimplemented": 404,
                  "unavailable": 503, "deadline_exceeded": 504, "failed_precondition": 400}
FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}


class NewSandbox(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    template_id: str = Field("base", alias="templateID")
    timeout: float | None = Field(None, ge=0)
    metadata: dict[str, str] = Field(default_factory=dict)
    env_vars: dict[str, str] = Field(default_factory=dict, alias="envVars")
    allow_internet_access: bool | None = None
    auto_pause: bool = Field(False, alias="autoPause")
    memory_mb: int | None = Field(None, alias="memoryMB", ge=16)
    cpus: float | None = Field(None, alias="cpuCount", gt=0)


class Timeout(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timeout: float = Field(ge=0)


class Connect(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timeout: float | None = Field(None, ge=0)


class Fork(BaseModel):
    count: int = Field(1, ge=1, le=256)


class Restore(BaseModel):
    snapshot_id: str = Field(alias="snapshotID")


class Exec(BaseModel):
    cmd: str | list[str]
    timeout: float | None = Field(None, ge=0)
    cwd: str | None = None
    envs: dict[str, str] = Field(default_factory=dict)


class Unauthorized(SandboxError):
    status = 401


class ConnectError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _sandbox_json(s: Sandbox) -> dict:
    return {"templateID": s.template, "sandboxID": s.id, "clientID": "k3", "envdVersion": ENVD_VERSION,
            "envdAccessToken": s.token, "alias": s.alias, "domain": None}


def _detail_json(s: Sandbox) -> dict:
    return _sandbox_json(s) | {
        "startedAt": _iso(s.started_at), "endAt": _iso(s.end_at), "cpuCount": max(1, round(s.cpus)),
        "memoryMB": s.memory_mb, "diskSizeMB": 0, "state": s.state, "metadata": s.metadata,
        "allowInternetAccess": False,
        "lifecycle": {"autoResume": False, "onTimeout": "pause" if s.auto_pause else "kill"}}


def _error(status: int, message: str, **headers) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers or None)


def _envelope(msg: dict, flags: int = 0) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(body)) + body


def create_app(manager: Manager, api_key: str | None = None, reap_every: float = 0.5) -> FastAPI:
    """The API over `manager`; with `api_key`, control-plane calls need `X-API-Key: <api_key>`."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # streams and blocking manager calls run in threads; 64 sandboxes at once need more than anyio's 40
        anyio.to_thread.current_default_thread_limiter().total_tokens = 256

        async def reaper():
            while True:
                await asyncio.sleep(reap_every)
                await anyio.to_thread.run_sync(manager.reap)

        task = asyncio.create_task(reaper())
        yield
        task.cancel()

    app = FastAPI(title="k3 sandbox", version=ENVD_VERSION, lifespan=lifespan,
                  description="E2B-compatible sandbox API (control plane + envd data plane) with fork and snapshots")

    def run(fn, *args, **kwargs):
        return anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    # ---- errors ----------------------------------------------------------------------------------------

    @app.exception_handler(SandboxError)
    async def sandbox_error(request: Request, e: SandboxError):
        return _error(e.status, str(e), **({"Should-Retry": "false"} if e.status == 502 else {}))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return _error(400, "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(ConnectError)
    async def connect_error(request: Request, e: ConnectError):
        return JSONResponse({"code": e.code, "message": e.message}, status_code=CONNECT_STATUS.get(e.code, 500))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        return _error(500, f"{type(e).__name__}: {e}")

    # ---- control plane ---------------------------------------------------------------------------------

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        data_plane = "e2b-sandbox-id" in request.headers or request.url.path.startswith(
            ("/files", "/process.", "/filesystem.", "/docs", "/openapi.json"))
        if (api_key and not data_plane and request.url.path != "/health"
                and not hmac.compare_digest(request.headers.get("x-api-key", ""), api_key)):
            return _error(401, "invalid API key (X-API-Key)")
        return await call_next(request)

    @app.get("/health")
    async def health(request: Request):
        if "e2b-sandbox-id" in request.headers:
            _data_sandbox(request)
            return Response(status_code=204)
        return {"status": "ok", "sandboxes": len(manager.list())}

    @app.post("/sandboxes", status_code=201)
    @app.post("/v2/sandboxes", status_code=201)
    async def create(body: NewSandbox):
        s = await run(manager.create, body.template_id, body.timeout, body.metadata, body.env_vars,
                      body.auto_pause, body.memory_mb, body.cpus, None, body.allow_internet_access)
        return _sandbox_json(s)

    @app.get("/sandboxes")
    @app.get("/v2/sandboxes")
    async def list_sandboxes(state: str | None = None, metadata: str | None = None):
        from urllib.parse import parse_qsl, unquote

        states = set(state.split(",")) if state else {"running", "paused"}
        want = {unquote(k): unquote(v) for k, v in parse_qsl(metadata or "")}
        return [_detail_json(s) for s in manager.list()
                if s.state in states and all(s.metadata.get(k) == v for k, v in want.items())]

    @app.get("/sandboxes/{sid}")
    async def get_sandbox(sid: str):
        return _detail_json(manager.get(sid))

    @app.delete("/sandboxes/{sid}", status_code=204)
    async def kill(sid: str):
        await run(manager.kill, sid)

    @app.post("/sandboxes/{sid}/timeout", status_code=204)
    async def set_timeout(sid: str, body: Timeout):
        manager.set_timeout(sid, body.timeout)

    @app.post("/sandboxes/{sid}/pause", status_code=204)
    async def pause(sid: str):
        if not await run(manager.pause, sid):
            return _error(409, f"sandbox {sid} is already paused")

    @app.post("/sandboxes/{sid}/connect")
    @app.post("/v2/sandboxes/{sid}/connect")
    @app.post("/sandboxes/{sid}/resume")
    async def connect(sid: str, body: Connect | None = None):
        resumed = await run(manager.resume, sid, body.timeout if body else None)
        return JSONResponse(_sandbox_json(manager.get(sid)), status_code=201 if resumed else 200)

    @app.get("/sandboxes/{sid}/metrics")
    async def metrics(sid: str):
        manager.get(sid)
        return []

    @app.post("/sandboxes/{sid}/fork", status_code=201)
    async def fork(sid: str, body: Fork):
        return {"sandboxes": [_sandbox_json(s) for s in await run(manager.fork, sid, body.count)]}

    @app.post("/sandboxes/{sid}/snapshots", status_code=201)
    async def snapshot(sid: str):
        lid = await run(manager.snapshot, sid)
        return {"snapshotID": lid, "sandboxID": sid}

    @app.get("/sandboxes/{sid}/snapshots")
    async def sandbox_snapshots(sid: str):
        manager.get(sid)
        return [_snapshot_json(i) for i in manager.snapshots(sid)]

    @app.get("/snapshots")
    async def all_snapshots():
        return [_snapshot_json(i) for i in manager.snapshots()]

    @app.delete("/snapshots/{snap}", status_code=204)
    async def delete_snapshot(snap: str):
        await run(manager.delete_snapshot, snap)

    @app.post("/sandboxes/{sid}/restore")
    async def restore(sid: str, body: Restore):
        return _sandbox_json(await run(manager.restore, sid, body.snapshot_id))

    @app.post("/sandboxes/{sid}/exec")
    async def exec_(sid: str, body: Exec):
        r = await run(manager.exec, sid, body.cmd, body.envs, body.cwd, body.timeout)
        return {"stdout": r.stdout, "stderr": r.stderr, "exitCode": r.exit_code, "duration": r.duration,
                "error": r.error}

    @app.get("/sandboxes/{sid}/tree-hash")
    async def tree_hash(sid: str, path: str = "/"):
        return {"sha256": await run(manager.tree_hash, sid, sandbox_path(path))}

    @app.get("/templates")
    async def templates():
        return manager.templates.list()

    # ---- data plane: envd ------------------------------------------------------------------------------

    def _data_sandbox(request: Request) -> Sandbox:
        sid = request.headers.get("e2b-sandbox-id", "")
        s = manager.sandboxes.get(sid)
        if s is None or s.state != "running":
            raise NotRunning(f"The sandbox {sid} was not found")
        if not hmac.compare_digest(request.headers.get("x-access-token", ""), s.token):
            raise Unauthorized("invalid or missing X-Access-Token for this sandbox")
        return s

    @app.get("/files")
    async def read_file(request: Request, path: str, username: str | None = None):
        s = _data_sandbox(request)
        try:
            data = await run(manager.read_file, s.id, path)
        except (FileNotFoundError, NotADirectoryError):
            return _error(404, f"path '{path}' does not exist")
        except (IsADirectoryError, ValueError) as e:
            return _error(400, str(e))
        except OverflowError as e:
            return _error(413, str(e))
        return Response(data, media_type="application/octet-stream")

    @app.post("/files")
    async def write_files(request: Request, path: str | None = None, username: str | None = None):
        s = _data_sandbox(request)
        limit = manager.config.max_file_bytes
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit + (64 << 10):
                return _error(413, f"upload over the {limit} byte file limit")
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("multipart/form-data"):
            files = _multipart(bytes(body), ctype)
            if path is not None and len(files) == 1:
                files = [(path, files[0][1])]
        else:
            if path is None:
                return _error(400, "octet-stream uploads need ?path=")
            if request.headers.get("content-encoding") == "gzip":
                import gzip

                body = bytearray(gzip.decompress(bytes(body)))
            files = [(path, bytes(body))]
        if not files:
            return _error(400, "no file in the upload")
        out = []
        for p, data in files:
            try:
                written = await run(manager.write_file, s.id, p, data)
            except OverflowError as e:
                return _error(413, str(e))
            except (IsADirectoryError, NotADirectoryError, ValueError) as e:
                return _error(400, str(e))
            except PermissionError as e:
                return _error(403, str(e))
            out.append({"name": written.rsplit("/", 1)[-1], "type": "file", "path": written})
        return out

    @app.post("/process.Process/Start")
    async def process_start(request: Request):
        s = _data_sandbox(request)
        body = _unenvelope(await request.body())
        timeout_ms = request.headers.get("connect-timeout-ms")
        keepalive = float(request.headers.get("keepalive-ping-interval", "50"))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def events():
            try:
                proc = body.get("process") or {}
                if body.get("pty"):
                    raise ConnectError("unimplemented", "PTY is not supported by this server")
                if not proc.get("cmd"):
                    raise ConnectError("invalid_argument", "process.cmd is required")
                cmd = await run(manager.start, s.id, [proc["cmd"], *proc.get("args", [])], proc.get("envs"),
                                proc.get("cwd"), int(timeout_ms) / 1000 if timeout_ms else 0,
                                bool(body.get("stdin")), body.get("tag"))
            except ConnectError as e:
                yield _envelope({"error": {"code": e.code, "message": e.message}}, 2)
                return
            except SandboxError as e:
                code = "not_found" if isinstance(e, (NotFound, NotRunning)) else "invalid_argument"
                yield _envelope({"error": {"code": code, "message": str(e)}}, 2)
                return

            def pump():
                for name, data in cmd.stream():
                    loop.call_soon_threadsafe(queue.put_nowait, (name, data))
                loop.call_soon_threadsafe(queue.put_nowait, None)

            threading.Thread(target=pump, daemon=True).start()
            yield _envelope({"event": {"start": {"pid": cmd.pid}}})
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), keepalive)
                except TimeoutError:
                    yield _envelope({"event": {"keepalive": {}}})
                    continue
                if item is None:
                    break
                yield _envelope({"event": {"data": {item[0]: base64.b64encode(item[1]).decode()}}})
            yield _envelope({"event": {"end": _end_event(cmd)}})
            yield _envelope({}, 2)

        return StreamingResponse(events(), media_type="application/connect+json")

    @app.post("/process.Process/{method}")
    async def process_unary(request: Request, method: str):
        s = _data_sandbox(request)
        body = await _unary_body(request)
        sel = body.get("process") or {}
        if method == "List":
            return {"processes": [{"config": {"cmd": c.argv[0], "args": c.argv[1:], "envs": c.envs, "cwd": c.cwd},
                                   "pid": c.pid, **({"tag": c.tag} if c.tag else {})}
                                  for c in list(manager.commands.get(s.id, {}).values())]}
        if method not in ("SendSignal", "SendInput", "CloseStdin"):
            raise ConnectError("unimplemented", f"process.Process/{method} is not supported by this server")
        cmd = _select(s.id, sel)
        if method == "SendSignal":
            cmd.kill("signal")
        elif method == "SendInput":
            data = base64.b64decode((body.get("input") or {}).get("stdin", ""))
            try:
                await run(cmd.send_input, data)
            except (SandboxError, OSError) as e:
                raise ConnectError("failed_precondition", str(e)) from None
        else:
            cmd.close_stdin()
        return {}

    def _select(sid: str, sel: dict):
        table = manager.commands.get(sid, {})
        if "pid" in sel and int(sel["pid"]) in table:
            return table[int(sel["pid"])]
        for c in table.values():
            if sel.get("tag") is not None and c.tag == sel["tag"]:
                return c
        raise ConnectError("not_found", f"process {sel} not found")

    @app.post("/filesystem.Filesystem/{method}")
    async def filesystem(request: Request, method: str):
        s = _data_sandbox(request)
        body = await _unary_body(request)
        path = body.get("path", "")

        def call():
            with manager.files(s.id) as root:
                if method == "Stat":
                    return {"entry": _entry_json(root.entry(path), manager.uid)}
                if method == "ListDir":
                    if not root.is_dir(path):
                        root.entry(path)  # FileNotFoundError if missing
                        raise NotADirectoryError(f"path '{path}' is not a directory")
                    depth = int(body.get("depth") or 1)
                    return {"entries": [_entry_json(e, manager.uid) for e in root.list(path, depth)]}
                if method == "MakeDir":
                    if not root.make_dirs(path):
                        raise FileExistsError(f"directory '{path}' already exists")
                    return {"entry": _entry_json(root.entry(path), manager.uid)}
                if method == "Remove":
                    with contextlib.suppress(FileNotFoundError):
                        root.remove(path)
                    return {}
                if method == "Move":
                    dst = root.move(body.get("source", ""), body.get("destination", ""))
                    return {"entry": _entry_json(root.entry(dst), manager.uid)}
                raise ConnectError("unimplemented", f"filesystem.Filesystem/{method} is not supported")

        try:
            return await run(call)
        except FileNotFoundError as e:
            raise ConnectError("not_found", f"path '{e.filename or path}' does not exist") from None
        except FileExistsError as e:
            raise ConnectError("already_exists", str(e)) from None
        except (NotADirectoryError, IsADirectoryError, ValueError) as e:
            raise ConnectError("invalid_argument", str(e)) from None
        except PermissionError as e:
            raise ConnectError("permission_denied", str(e)) from None

    @app.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def unknown(rest: str):
        if "." in rest.split("/")[0]:
            raise ConnectError("unimplemented", f"/{rest} is not supported by this server")
        return _error(404, f"no route /{rest}")

    return app


def _snapshot_json(info: dict) -> dict:
    return {"snapshotID": info["id"], "sandboxID": info["sandbox"], "templateID": info["template"],
            "parentID": info["parent"], "createdAt": _iso(info["created_at"])}


def _end_event(cmd) -> dict:
    if cmd.returncode is not None and cmd.returncode < 0:
        end: dict[str, Any] = {"exitCode": -1, "exited": False, "status": "signal: killed"}
        end["error"] = cmd.error or "signal: killed"
        return end
    end = {"exitCode": cmd.exit_code, "exited": True, "status": f"exit status {cmd.exit_code}"}
    if cmd.exit_code:
        end["error"] = end["status"]
    return end


def _entry_json(e, sandbox_uid: int) -> dict:
    owner = {sandbox_uid: "user", 0: "root"}
    kind = {"dir": stat.S_IFDIR, "symlink": stat.S_IFLNK}.get(e.type, stat.S_IFREG)
    out = {"name": e.name, "type": FILE_TYPES.get(e.type, "FILE_TYPE_UNSPECIFIED"), "path": e.path,
           "size": str(e.size), "mode": e.mode, "permissions": stat.filemode(e.mode | kind),
           "owner": owner.get(e.uid, str(e.uid)), "group": owner.get(e.gid, str(e.gid)),
           "modifiedTime": _iso(e.mtime)}
    if e.symlink_target is not None:
        out["symlinkTarget"] = e.symlink_target
    return out


def _unenvelope(raw: bytes) -> dict:
    if len(raw) < 5:
        raise ConnectError("invalid_argument", "empty stream request")
    flags, n = struct.unpack(">BI", raw[:5])
    if flags & 1:
        raise ConnectError("unimplemented", "compressed messages are not supported")
    return json.loads(raw[5:5 + n] or b"{}")


async def _unary_body(request: Request) -> dict:
    raw = await request.body()
    try:
        return json.loads(raw or b"{}")
    except ValueError:
        raise ConnectError("invalid_argument", "the request is not JSON") from None


def _multipart(body: bytes, ctype: str) -> list[tuple[str, bytes]]:
    """(filename, content) of each part of a multipart/form-data body; the filename is the target path."""
    boundary = next((p.split("=", 1)[1].strip('"') for p in ctype.split(";") if p.strip().startswith("boundary=")),
                    None)
    if not boundary:
        raise SandboxError("multipart upload without a boundary")
    files = []
    for part in body.split(b"--" + boundary.encode())[1:]:
        if part.startswith(b"--"):
            break
        head, _, content = part.partition(b"\r\n\r\n")
        if content.endswith(b"\r\n"):
            content = content[:-2]
        name = None
        for line in head.decode(errors="replace").split("\r\n"):
            if line.lower().startswith("content-disposition"):
                for field in line.split(";"):
                    k, _, v = field.strip().partition("=")
                    if k == "filename":
                        name = v.strip('"')
        if name is not None:
            files.append((name, content))
    return files
