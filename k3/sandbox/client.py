"""A small client for what the `e2b` SDK lacks: fork, snapshots and restore (AgentENV's additions), plus
exec, files, pause and kill so one object covers a whole trajectory. Works against `k3 sandbox serve`.

    c = Client("http://127.0.0.1:49999", api_key="...")
    sbx = c.create(timeout=600)
    sbx.write_file("/home/user/solution.py", code)
    judges = sbx.fork(4)                  # four independent copies of the sandbox as it is now
    [j.exec("python3 -m pytest -q tests/") for j in judges]
    snap = sbx.snapshot(); ...; sbx.restore(snap)
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx


class SandboxAPIError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


@dataclass
class Result:
    stdout: str
    stderr: str
    exit_code: int
    duration: float
    error: str | None = None


class Client:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0):
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout,
                                 headers={"X-API-Key": api_key} if api_key else {})

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        r = self.http.request(method, path, **kwargs)
        if r.status_code >= 400:
            try:
                message = r.json().get("message", r.text)
            except ValueError:
                message = r.text
            raise SandboxAPIError(r.status_code, message)
        return r

    def create(self, template: str = "base", timeout: float | None = None, metadata: dict | None = None,
               envs: dict | None = None, auto_pause: bool = False, memory_mb: int | None = None) -> RemoteSandbox:
        """A sandbox from a template name/id or a snapshot id."""
        body = {"templateID": template, "metadata": metadata or {}, "envVars": envs or {}, "autoPause": auto_pause}
        if timeout is not None:
            body["timeout"] = timeout
        if memory_mb is not None:
            body["memoryMB"] = memory_mb
        return RemoteSandbox(self, self.request("POST", "/v2/sandboxes", json=body).json())

    def connect(self, sandbox_id: str, timeout: float | None = None) -> RemoteSandbox:
        body = {} if timeout is None else {"timeout": timeout}
        return RemoteSandbox(self, self.request("POST", f"/v2/sandboxes/{sandbox_id}/connect", json=body).json())

    def list(self) -> list[dict]:
        return self.request("GET", "/v2/sandboxes").json()

    def snapshots(self) -> list[dict]:
        return self.request("GET", "/snapshots").json()

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.request("DELETE", f"/snapshots/{snapshot_id}")

    def close(self) -> None:
        self.http.close()


class RemoteSandbox:
    def __init__(self, client: Client, info: dict):
        self.client, self.id, self.token = client, info["sandboxID"], info.get("envdAccessToken", "")

    def _envd_headers(self) -> dict:
        return {"E2b-Sandbox-Id": self.id, "E2b-Sandbox-Port": "49983", "X-Access-Token": self.token}

    def exec(self, cmd: str | list[str], timeout: float | None = None, cwd: str | None = None,
             envs: dict | None = None) -> Result:
        """Run `cmd` (a string runs under /bin/sh -c) to its end."""
        body = {"cmd": cmd, "timeout": timeout, "cwd": cwd, "envs": envs or {}}
        read_timeout = None if not timeout else timeout + 30
        r = self.client.request("POST", f"/sandboxes/{self.id}/exec", json=body, timeout=read_timeout).json()
        return Result(r["stdout"], r["stderr"], r["exitCode"], r["duration"], r.get("error"))

    def write_file(self, path: str, data: bytes | str) -> str:
        data = data.encode() if isinstance(data, str) else data
        r = self.client.request("POST", "/files", params={"path": path}, content=data,
                                headers=self._envd_headers() | {"Content-Type": "application/octet-stream"})
        return r.json()[0]["path"]

    def read_file(self, path: str) -> bytes:
        return self.client.request("GET", "/files", params={"path": path}, headers=self._envd_headers()).content

    def snapshot(self) -> str:
        return self.client.request("POST", f"/sandboxes/{self.id}/snapshots").json()["snapshotID"]

    def snapshots(self) -> list[dict]:
        return self.client.request("GET", f"/sandboxes/{self.id}/snapshots").json()

    def restore(self, snapshot_id: str) -> None:
        self.client.request("POST", f"/sandboxes/{self.id}/restore", json={"snapshotID": snapshot_id})

    def fork(self, count: int = 1) -> list[RemoteSandbox]:
        r = self.client.request("POST", f"/sandboxes/{self.id}/fork", json={"count": count}).json()
        return [RemoteSandbox(self.client, s) for s in r["sandboxes"]]

    def pause(self) -> bool:
        """False when it was already paused (409)."""
        return self._done_unless("POST", f"/sandboxes/{self.id}/pause", 409)

    def resume(self, timeout: float | None = None) -> None:
        self.client.connect(self.id, timeout)

    def set_timeout(self, seconds: float) -> None:
        self.client.request("POST", f"/sandboxes/{self.id}/timeout", json={"timeout": seconds})

    def info(self) -> dict:
        return self.client.request("GET", f"/sandboxes/{self.id}").json()

    def tree_hash(self, path: str = "/") -> str:
        return self.client.request("GET", f"/sandboxes/{self.id}/tree-hash", params={"path": path}).json()["sha256"]

    def kill(self) -> bool:
        """False when it was already gone (404)."""
        return self._done_unless("DELETE", f"/sandboxes/{self.id}", 404)

    def _done_unless(self, method: str, path: str, status: int) -> bool:
        try:
            self.client.request(method, path)
            return True
        except SandboxAPIError as e:
            if e.status == status:
                return False
            raise
