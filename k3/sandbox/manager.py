"""The sandbox manager, backend A (K3 report §5.3.2, AgentENV, rebuilt without a VM): overlayfs + bubblewrap.

A sandbox is a folder: `upper/` and `work/` of an overlay mounted on `merged/` over
`[newest layer, ..., oldest layer, template]`, a cgroup, and `state.json`. No process lives between calls:
each command is `sh` (joins the cgroup, sets rlimits) -> `setpriv` (drops to the sandbox host uid) ->
`bwrap` (new user, mount, pid, net, ipc, uts and cgroup namespaces; only `lo`; all capabilities dropped;
environment cleared; new session; dies with the manager) -> the command, with `merged/` as `/`. When the
command ends its pid namespace ends, and everything it started with it.

- snapshot: unmount, rename `upper/` to `layers/<id>` with a manifest, mount a fresh upper. O(1) in the
  sandbox's size, and incremental: a layer holds what changed since the previous one.
- fork(n): a snapshot, then n sandboxes with fresh uppers over the same layers.
- restore: a fresh upper over any snapshot's layers (also `create(template=<snapshot id>)`).
- pause: the cgroup freezer (running commands stop using CPU; resume continues them).
- timeouts: a sandbox past its end is paused (auto-pause) or killed by `reap()`; a command past its own
  timeout is killed with its whole pid namespace.
- kill: the cgroup's processes killed, the overlay unmounted, the cgroup and the folder removed.
- stacks deeper than `max_layers` are flattened in a background thread (hard links, no data copied).
- state: everything is on disk; a new manager on the same state folder lists the same sandboxes again
  (remounting if needed) and removes what it cannot recover.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from k3.sandbox import probe
from k3.sandbox.cgroup import Cgroup, detect
from k3.sandbox.fs import HOME, Root, sandbox_path
from k3.sandbox.layers import flatten, mount_overlay, mounted, tree_hash, umount
from k3.sandbox.template import NAME, USER_UID, Templates, build_host_template

log = logging.getLogger("k3.sandbox")
CHUNK = 32 << 10  # output pieces, as envd sends them
# joins every cgroup named before `--`, sets rlimits, then execs the rest (pid kept, so bwrap is in the cgroup)
LAUNCHER = ('while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; '
            'ulimit -c 0; ulimit -n "$K3_NOFILE"; ulimit -f "$K3_FSIZE"; unset K3_NOFILE K3_FSIZE; exec "$@"')


class SandboxError(Exception):
    status = 400


class NotFound(SandboxError):
    status = 404


class NotRunning(SandboxError):
    """Paused or gone: the data plane answers as E2B does for a sandbox that is not running."""
    status = 502


class Busy(SandboxError):
    status = 409


def default_state_dir() -> Path:
    """$K3_SANDBOX_DIR, else /var/lib/k3-sandbox for root, else ~/.cache/k3-sandbox."""
    if os.environ.get("K3_SANDBOX_DIR"):
        return Path(os.environ["K3_SANDBOX_DIR"])
    return Path("/var/lib/k3-sandbox") if os.geteuid() == 0 else Path.home() / ".cache" / "k3-sandbox"


@dataclass
class SandboxConfig:
    """Manager-wide settings; per-sandbox limits can be lowered or raised at create."""
    state_dir: Path = field(default_factory=default_state_dir)
    memory_mb: int = 512
    pids: int = 256
    cpus: float = 1.0
    timeout: float = 300.0  # seconds a sandbox lives without set_timeout/connect (E2B's default)
    command_timeout: float = 60.0  # per command, when the caller gives none (E2B's default)
    max_output_bytes: int = 16 << 20  # per command; past it the command is killed
    max_file_bytes: int = 64 << 20  # per read or write through the API
    max_file_size: int = 1 << 30  # RLIMIT_FSIZE inside
    open_files: int = 1024  # RLIMIT_NOFILE inside
    max_layers: int = 32  # deeper stacks are flattened in the background
    host_uid: int = 64000  # the unprivileged host uid and gid sandboxes run as (the manager's own if not root)


@dataclass
class Sandbox:
    id: str
    template: str  # template id
    layers: list[str]  # layer ids, newest first
    token: str  # E2B's envdAccessToken: the data plane checks it
    started_at: float
    end_at: float
    state: str = "running"  # running | paused
    metadata: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False
    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 256
    alias: str | None = None


@dataclass
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int  # 128 + signal when killed, as a shell reports it
    duration: float  # seconds
    error: str | None = None  # "timeout" or "output limit" when the manager killed it


class Command:
    """One running command: its output as a stream of (stream name, bytes), then its exit status."""

    def __init__(self, sandbox: str, popen: subprocess.Popen, timeout: float | None, max_output: int,
                 argv: list[str], envs: dict[str, str], cwd: str, tag: str | None):
        self.sandbox, self.popen, self.pid = sandbox, popen, popen.pid
        self.argv, self.envs, self.cwd, self.tag = argv, envs, cwd, tag
        self.started = time.monotonic()
        self.deadline = self.started + timeout if timeout else None
        self.max_output = max_output
        self.returncode: int | None = None
        self.error: str | None = None
        self.duration = 0.0
        self.done = threading.Event()
        self.on_done = lambda command: None

    def stream(self) -> Iterator[tuple[str, bytes]]:
        sel = selectors.DefaultSelector()
        sel.register(self.popen.stdout, selectors.EVENT_READ, "stdout")
        sel.register(self.popen.stderr, selectors.EVENT_READ, "stderr")
        total, finished = 0, False
        try:
            while sel.get_map():
                wait = 1.0
                if self.deadline is not None and self.error is None:
                    wait = self.deadline - time.monotonic()
                    if wait <= 0:
                        self.kill("timeout")
                        wait = 1.0
                for key, _ in sel.select(max(0.0, min(wait, 1.0))):
                    data = os.read(key.fd, CHUNK)
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    total += len(data)
                    if total > self.max_output and self.error is None:
                        self.kill("output limit")
                    if self.error is None:
                        yield key.data, data
            finished = True
        finally:
            sel.close()
            if not finished:
                self.kill(self.error or "stream closed")
            left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            try:
                self.returncode = self.popen.wait(left)
            except subprocess.TimeoutExpired:  # output closed, process still running
                self.kill("timeout")
                self.returncode = self.popen.wait()
            self.duration = time.monotonic() - self.started
            for f in (self.popen.stdout, self.popen.stderr, self.popen.stdin):
                if f is not None:
                    f.close()
            self.on_done(self)
            self.done.set()

    @property
    def exit_code(self) -> int:
        rc = self.returncode
        return 128 - rc if rc is not None and rc < 0 else (rc or 0)

    def kill(self, reason: str | None = None) -> None:
        """SIGKILL bwrap's process group; its pid namespace, and every process in it, goes too."""
        if self.error is None:
            self.error = reason
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def send_input(self, data: bytes) -> None:
        if self.popen.stdin is None:
            raise SandboxError("the command was started without stdin")
        self.popen.stdin.write(data)
        self.popen.stdin.flush()

    def close_stdin(self) -> None:
        if self.popen.stdin is not None:
            self.popen.stdin.close()


class Manager:
    """All sandboxes of one state folder. Thread-safe: the server calls it from many threads."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config = config or SandboxConfig()
        for name in ("bwrap", "overlay"):
            p = getattr(probe, name)()
            if not p:
                raise RuntimeError(f"sandboxes are unavailable here: {p.reason}")
        self.bwrap = probe.bwrap_path()
        self.root_mode = os.geteuid() == 0
        self.uid = self.gid = config.host_uid if self.root_mode else os.getuid()
        self.setpriv = shutil.which("setpriv", path="/usr/bin:/bin")
        if self.root_mode and self.setpriv is None:
            raise RuntimeError("running as root needs setpriv (util-linux) to drop to the sandbox uid")
        cg = probe.cgroups()
        self.cgroup_layout = detect() if cg else None
        self.cgroup_reason = cg.reason
        self.dir = Path(config.state_dir)
        for d in ("sandboxes", "layers", "trash"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        # bwrap runs as the sandbox uid: it must reach merged/ through every folder above it
        for d in (self.dir, self.dir / "sandboxes"):
            os.chmod(d, 0o711)
        closed = [p for p in self.dir.resolve().parents if not os.stat(p).st_mode & stat.S_IXOTH]
        if self.root_mode and closed:
            raise RuntimeError(f"state folder {self.dir} is not reachable by the sandbox uid: {closed[0]} lacks o+x")
        self.templates = Templates(self.dir / "templates")
        self.sandboxes: dict[str, Sandbox] = {}
        self.commands: dict[str, dict[int, Command]] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.lock = threading.Lock()
        self.flattening: set[str] = set()
        self.unborn: set[str] = set()  # layers being flattened, not yet in any stack: the collector skips them
        self._trash = threading.Event()
        self._build_lock = threading.Lock()
        self._recover()
        threading.Thread(target=self._trash_worker, daemon=True).start()

    # ---- templates -------------------------------------------------------------------------------------

    def ensure_template(self, name: str = "base") -> str:
        """The id of template `name`, building the default one from this host if it is missing."""
        tid = self.templates.resolve(name)
        if tid is None and name == "base":
            with self._build_lock:
                tid = self.templates.resolve(name) or build_host_template(self.templates, self.uid, self.gid)
        if tid is None:
            raise NotFound(f"template {name!r} not found")
        return tid

    # ---- lifecycle -------------------------------------------------------------------------------------

    def create(self, template: str = "base", timeout: float | None = None, metadata: dict | None = None,
               envs: dict | None = None, auto_pause: bool = False, memory_mb: int | None = None,
               cpus: float | None = None, pids: int | None = None, allow_internet_access: bool | None = None,
               ) -> Sandbox:
        """A new sandbox from a template name or id, or from a snapshot id (its files as they were)."""
        if allow_internet_access:
            raise SandboxError("allow_internet_access=true is not supported: sandboxes only have loopback")
        tid, layers = self._resolve_source(template)
        c = self.config
        now = time.time()
        sbx = Sandbox(id="i" + secrets.token_hex(10), template=tid, layers=layers, token=secrets.token_hex(16),
                      started_at=now, end_at=now + (c.timeout if timeout is None else timeout),
                      metadata=dict(metadata or {}), envs=dict(envs or {}), auto_pause=auto_pause,
                      memory_mb=memory_mb or c.memory_mb, cpus=cpus or c.cpus, pids=pids or c.pids,
                      alias=template if template != tid else None)
        _check_env(sbx.envs)
        self._start(sbx)
        return sbx

    def _resolve_source(self, name: str) -> tuple[str, list[str]]:
        if self._is_snapshot(name):
            return self._layer_info(name)["template"], self._chain(name)
        return self.ensure_template(name), []

    def _is_snapshot(self, name: str) -> bool:
        f = self.dir / "layers" / f"{name}.json"
        return NAME.fullmatch(name) is not None and f.exists() and json.loads(f.read_text())["kind"] == "snapshot"

    def _start(self, sbx: Sandbox) -> None:
        d = self._dir(sbx.id)
        try:
            for sub in ("upper", "work", "merged"):
                (d / sub).mkdir(parents=True)
            self._mount(sbx)
            if self.cgroup_layout:
                Cgroup(self.cgroup_layout, sbx.id).create(sbx.memory_mb << 20, sbx.pids, sbx.cpus)
            with self.lock:
                self.sandboxes[sbx.id] = sbx
                self.commands[sbx.id] = {}
                self.locks[sbx.id] = threading.Lock()
            self._save(sbx)
        except BaseException:
            self._destroy(sbx.id)
            raise

    def _mount(self, sbx: Sandbox) -> None:
        d = self._dir(sbx.id)
        # a volatile overlay leaves work/work/incompat/volatile behind, which refuses the next mount; a fresh
        # folder costs one rename where deleting it costs three rmdirs (milliseconds each on a busy disk)
        if any(os.scandir(d / "work")):
            (d / "work").rename(self.dir / "trash" / uuid.uuid4().hex)
            (d / "work").mkdir()
            self._trash.set()
        lowers = [self.dir / "layers" / lid for lid in sbx.layers] + [self.templates.root(sbx.template)]
        mount_overlay(d / "merged", lowers, d / "upper", d / "work")

    def get(self, sid: str) -> Sandbox:
        sbx = self.sandboxes.get(sid)
        if sbx is None:
            raise NotFound(f"sandbox {sid!r} not found")
        return sbx

    def list(self) -> list[Sandbox]:
        return list(self.sandboxes.values())

    def running(self, sid: str) -> Sandbox:
        sbx = self.sandboxes.get(sid)
        if sbx is None or sbx.state != "running":
            raise NotRunning(f"The sandbox {sid} was not found")
        return sbx

    def kill(self, sid: str) -> None:
        self.get(sid)
        with self._lock(sid):
            for cmd in list(self.commands.get(sid, {}).values()):
                cmd.kill("sandbox killed")
            self._destroy(sid)
        self._collect_layers()

    def _destroy(self, sid: str) -> None:
        """Remove everything of a sandbox: processes, cgroup, mount, folder. Safe on half-made ones."""
        if self.cgroup_layout:
            Cgroup(self.cgroup_layout, sid).remove()
        d = self._dir(sid)
        merged = d / "merged"
        if str(merged) in mounted():
            try:
                umount(merged)
            except OSError:
                # a process of a dying command can still hold it for a moment
                umount(merged, lazy=True)
        with self.lock:
            self.sandboxes.pop(sid, None)
            self.commands.pop(sid, None)
            self.locks.pop(sid, None)
        if d.exists():
            d.rename(self.dir / "trash" / uuid.uuid4().hex)
            self._trash.set()

    def set_timeout(self, sid: str, seconds: float) -> Sandbox:
        sbx = self.get(sid)
        sbx.end_at = time.time() + seconds
        self._save(sbx)
        return sbx

    def pause(self, sid: str) -> bool:
        """Freeze every process of the sandbox; False when it was already paused."""
        sbx = self.get(sid)
        if not self.cgroup_layout:
            raise SandboxError(f"pause needs the cgroup freezer: {self.cgroup_reason}")
        with self._lock(sid):
            if sbx.state == "paused":
                return False
            Cgroup(self.cgroup_layout, sid).freeze()
            sbx.state = "paused"
            self._save(sbx)
        return True

    def resume(self, sid: str, timeout: float | None = None) -> bool:
        """Thaw a paused sandbox (True) or leave a running one (False); `timeout` only extends its end."""
        sbx = self.get(sid)
        with self._lock(sid):
            resumed = sbx.state == "paused"
            if resumed:
                Cgroup(self.cgroup_layout, sid).thaw()
                sbx.state = "running"
            if timeout is not None:
                sbx.end_at = max(sbx.end_at, time.time() + timeout)
            self._save(sbx)
        return resumed

    def reap(self) -> list[str]:
        """Pause (auto-pause) or kill every running sandbox past its end; returns the ids handled."""
        now, done = time.time(), []
        for sbx in self.list():
            if sbx.state == "running" and sbx.end_at < now:
                try:
                    self.pause(sbx.id) if sbx.auto_pause else self.kill(sbx.id)
                    done.append(sbx.id)
                except SandboxError:
                    pass
        return done

    # ---- commands --------------------------------------------------------------------------------------

    def start(self, sid: str, cmd: str | list[str], envs: dict | None = None, cwd: str | None = None,
              timeout: float | None = None, stdin: bool = False, tag: str | None = None) -> Command:
        """Start a command (a string runs under `/bin/sh -c`); read its output with `Command.stream()`.

        `timeout` 0 means none; None means `config.command_timeout`.
        """
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        envs = dict(envs or {})
        _check_env(envs)
        cwd = sandbox_path(cwd or HOME)
        if timeout is None:
            timeout = self.config.command_timeout
        # under the sandbox's lock: a snapshot either sees this command running or runs before it starts
        with self._lock(sid):
            sbx = self.running(sid)
            with Root(self._merged(sid), self.uid, self.gid) as root:
                if not root.is_dir(cwd):
                    raise SandboxError(f"cwd '{cwd}' does not exist")
            popen = subprocess.Popen(self._launch_argv(sbx, argv, sbx.envs | envs, cwd),
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                     env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                                          "K3_NOFILE": str(self.config.open_files),
                                          "K3_FSIZE": str(self.config.max_file_size // 512)})
            command = Command(sid, popen, timeout or None, self.config.max_output_bytes, argv, envs, cwd, tag)
            command.on_done = self._forget
            self.commands[sid][command.pid] = command
        return command

    def _launch_argv(self, sbx: Sandbox, argv: list[str], envs: dict[str, str], cwd: str) -> list[str]:
        """sh (joins the cgroup, sets rlimits) -> setpriv (as root: drops to the sandbox uid) -> bwrap -> argv."""
        launch = ["/bin/sh", "-c", LAUNCHER, "k3-launch"]
        if self.cgroup_layout:
            launch += [str(f) for f in Cgroup(self.cgroup_layout, sbx.id).procs_files()]
        launch.append("--")
        if self.root_mode:
            launch += [self.setpriv, f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups"]
        launch += [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                   "--new-session", "--clearenv", "--cap-drop", "ALL", "--uid", str(USER_UID), "--gid",
                   str(USER_UID), "--hostname", "sandbox", "--bind", str(self._merged(sbx.id)), "/",
                   "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/run", "--chdir", cwd]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": HOME, "USER": "user", "LOGNAME": "user",
               "LANG": "C.UTF-8"} | envs
        for k, v in env.items():
            launch += ["--setenv", k, v]
        return launch + ["--", *argv]

    def _forget(self, command: Command) -> None:
        with self.lock:
            self.commands.get(command.sandbox, {}).pop(command.pid, None)

    def exec(self, sid: str, cmd: str | list[str], envs: dict | None = None, cwd: str | None = None,
             timeout: float | None = None) -> ExecResult:
        """Run a command to its end: stdout, stderr (UTF-8, invalid bytes replaced), exit code, duration."""
        command = self.start(sid, cmd, envs, cwd, timeout)
        out = {"stdout": bytearray(), "stderr": bytearray()}
        for name, data in command.stream():
            out[name] += data
        return ExecResult(out["stdout"].decode(errors="replace"), out["stderr"].decode(errors="replace"),
                          command.exit_code, command.duration, command.error)

    def command(self, sid: str, pid: int) -> Command:
        cmd = self.commands.get(sid, {}).get(pid)
        if cmd is None:
            raise NotFound(f"process {pid} not found")
        return cmd

    # ---- files -----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def files(self, sid: str) -> Iterator[Root]:
        """`with m.files(id) as root: root.read(...)` (see `k3.sandbox.fs`). Holds the sandbox's lock, so no
        snapshot or restore can unmount the tree under a file operation."""
        with self._lock(sid):
            self.running(sid)
            with Root(self._merged(sid), self.uid, self.gid) as root:
                yield root

    def _lock(self, sid: str) -> threading.Lock:
        lock = self.locks.get(sid)
        if lock is None:
            raise NotFound(f"sandbox {sid!r} not found")
        return lock

    def read_file(self, sid: str, path: str) -> bytes:
        with self.files(sid) as root:
            return root.read(path, self.config.max_file_bytes)

    def write_file(self, sid: str, path: str, data: bytes | str) -> str:
        data = data.encode() if isinstance(data, str) else data
        if len(data) > self.config.max_file_bytes:
            raise OverflowError(f"{len(data)} bytes is over the {self.config.max_file_bytes} byte file limit")
        with self.files(sid) as root:
            return root.write(path, data)

    def tree_hash(self, sid: str, path: str = "/") -> str:
        """sha256 of the sandbox's tree under `path` as the sandbox sees it (see `layers.tree_hash`)."""
        with self._lock(sid):
            return tree_hash(self._merged(sid) / path.lstrip("/"))

    # ---- snapshots, restore, fork ----------------------------------------------------------------------

    def snapshot(self, sid: str) -> str:
        """Seal the sandbox's changes as a new immutable layer; returns the snapshot (= layer) id."""
        with self._lock(sid):
            return self._seal(self.get(sid), "snapshot")

    def _seal(self, sbx: Sandbox, kind: str) -> str:
        if self.commands.get(sbx.id):
            raise Busy(f"sandbox {sbx.id} has {len(self.commands[sbx.id])} running commands; "
                       "snapshot, fork and restore need it idle")
        d = self._dir(sbx.id)
        top = self._layer_info(sbx.layers[0]) if sbx.layers else None
        if top and not any(os.scandir(d / "upper")) and (kind == "fork" or top["kind"] == kind):
            return top["id"]  # nothing changed since the last layer
        if len(sbx.layers) >= 2 * self.config.max_layers:
            # snapshots outran the background flattening: flatten now, before the mount options overflow
            merged = self._merge_layers(sbx, sbx.layers)
            try:
                self._remount(sbx, [merged])
            finally:
                self.unborn.discard(merged)
        lid = uuid.uuid4().hex[:12]
        umount(d / "merged")
        try:
            (d / "upper").rename(self.dir / "layers" / lid)
            # the whole stack is recorded: parents alone would lead through layers flattened since
            info = {"id": lid, "kind": kind, "parent": sbx.layers[0] if sbx.layers else None,
                    "stack": [lid, *sbx.layers], "template": sbx.template, "sandbox": sbx.id,
                    "created_at": time.time()}
            _write_json(self.dir / "layers" / f"{lid}.json", info)
            (d / "upper").mkdir()
            sbx.layers = [lid, *sbx.layers]
        finally:
            self._mount(sbx)
        self._save(sbx)
        if len(sbx.layers) > self.config.max_layers and sbx.id not in self.flattening:
            self.flattening.add(sbx.id)
            threading.Thread(target=self._flatten, args=(sbx.id, list(sbx.layers)), daemon=True).start()
        return lid

    def restore(self, sid: str, snapshot: str) -> Sandbox:
        """Put the sandbox back to `snapshot` (of it or of any sandbox): its current changes are dropped."""
        sbx = self.get(sid)
        if not self._is_snapshot(snapshot):
            raise NotFound(f"snapshot {snapshot!r} not found")
        with self._lock(sid):
            if self.commands.get(sid):
                raise Busy(f"sandbox {sid} has running commands")
            d = self._dir(sid)
            umount(d / "merged")
            (d / "upper").rename(self.dir / "trash" / uuid.uuid4().hex)
            (d / "upper").mkdir()
            sbx.template, sbx.layers = self._layer_info(snapshot)["template"], self._chain(snapshot)
            self._mount(sbx)
            self._save(sbx)
        self._trash.set()
        return sbx

    def fork(self, sid: str, count: int) -> list[Sandbox]:
        """`count` new sandboxes, each with the files of `sid` as they are now; `sid` itself goes on."""
        if not 1 <= count <= 256:
            raise SandboxError("fork count must be 1..256")
        sbx = self.get(sid)
        with self._lock(sid):
            self._seal(sbx, "fork")
            stack = list(sbx.layers)
        now = time.time()
        children = []
        for _ in range(count):
            child = Sandbox(id="i" + secrets.token_hex(10), template=sbx.template, layers=stack,
                            token=secrets.token_hex(16), started_at=now, end_at=max(sbx.end_at, now + 1),
                            metadata=dict(sbx.metadata), envs=dict(sbx.envs), auto_pause=sbx.auto_pause,
                            memory_mb=sbx.memory_mb, cpus=sbx.cpus, pids=sbx.pids, alias=sbx.alias)
            self._start(child)
            children.append(child)
        return children

    def snapshots(self, sid: str | None = None) -> list[dict]:
        """Snapshot manifests (newest last), of one sandbox or of all."""
        out = [json.loads(p.read_text()) for p in (self.dir / "layers").glob("*.json")]
        out = [i for i in out if i["kind"] == "snapshot" and (sid is None or i["sandbox"] == sid)]
        return sorted(out, key=lambda i: i["created_at"])

    def delete_snapshot(self, snapshot: str) -> None:
        info = self._layer_info(snapshot)
        if info["kind"] != "snapshot":
            raise NotFound(f"snapshot {snapshot!r} not found")
        info["kind"] = "deleted"
        _write_json(self.dir / "layers" / f"{snapshot}.json", info)
        self._collect_layers()

    def _layer_info(self, lid: str) -> dict:
        try:
            return json.loads((self.dir / "layers" / f"{lid}.json").read_text())
        except FileNotFoundError:
            raise NotFound(f"snapshot {lid!r} not found") from None

    def _chain(self, lid: str) -> list[str]:
        """The layer stack (newest first) a snapshot stands for."""
        return self._layer_info(lid)["stack"]

    def _collect_layers(self) -> None:
        """Delete fork, merged and deleted-snapshot layers that no sandbox and no kept snapshot stands on."""
        with self.lock:
            infos = {p.stem: json.loads(p.read_text()) for p in (self.dir / "layers").glob("*.json")}
            used = {lid for s in self.sandboxes.values() for lid in s.layers} | self.unborn
            for info in infos.values():
                if info["kind"] == "snapshot":
                    used |= set(info["stack"])
            for lid, info in infos.items():
                if lid not in used:
                    (self.dir / "layers" / f"{lid}.json").unlink()
                    if (self.dir / "layers" / lid).exists():
                        (self.dir / "layers" / lid).rename(self.dir / "trash" / lid)
        self._trash.set()

    def _merge_layers(self, sbx: Sandbox, layers: list[str]) -> str:
        """A new layer holding what `layers` (newest first) hold together; the caller discards `unborn`."""
        lid = uuid.uuid4().hex[:12]
        self.unborn.add(lid)
        flatten([self.dir / "layers" / x for x in reversed(layers)], self.dir / "layers" / lid)
        _write_json(self.dir / "layers" / f"{lid}.json",
                    {"id": lid, "kind": "merged", "parent": None, "stack": [lid], "template": sbx.template,
                     "sandbox": sbx.id, "created_at": time.time(), "merged_from": layers})
        return lid

    def _flatten(self, sid: str, layers: list[str]) -> None:
        """Merge a deep stack into one layer in the background, then switch the sandbox to it once it is idle."""
        lid = None
        try:
            lid = self._merge_layers(self.get(sid), layers)
            n = len(layers)
            # snapshots taken meanwhile sit on top of the flattened suffix; a restore replaces the stack
            for _ in range(600):
                sbx = self.sandboxes.get(sid)
                if sbx is None or sbx.layers[-n:] != layers:
                    break
                lock = self.locks.get(sid)
                if lock and not self.commands.get(sid) and lock.acquire(timeout=1):
                    try:
                        if sbx.layers[-n:] == layers and not self.commands.get(sid):
                            self._remount(sbx, sbx.layers[:-n] + [lid])
                            break
                    finally:
                        lock.release()
                time.sleep(0.1)
        except Exception:
            log.exception("flattening the layers of %s failed", sid)
        finally:
            self.unborn.discard(lid)
            self.flattening.discard(sid)
            self._collect_layers()

    def _remount(self, sbx: Sandbox, layers: list[str]) -> None:
        """Mount the sandbox over another stack; on failure it goes back to the one it had."""
        umount(self._dir(sbx.id) / "merged")
        old, sbx.layers = sbx.layers, layers
        try:
            self._mount(sbx)
        except OSError:
            sbx.layers = old
            self._mount(sbx)
            raise
        self._save(sbx)

    # ---- state -----------------------------------------------------------------------------------------

    def _dir(self, sid: str) -> Path:
        return self.dir / "sandboxes" / sid

    def _merged(self, sid: str) -> Path:
        return self._dir(sid) / "merged"

    def _save(self, sbx: Sandbox) -> None:
        _write_json(self._dir(sbx.id) / "state.json", asdict(sbx))

    def _empty_trash(self) -> None:
        for p in (self.dir / "trash").iterdir():
            shutil.rmtree(p, ignore_errors=True)

    def _trash_worker(self) -> None:
        """Deletes what kill and restore moved to trash/ (rmdir costs milliseconds each on a busy disk)."""
        while True:
            self._trash.wait()
            self._trash.clear()
            self._empty_trash()

    def _recover(self) -> None:
        """Adopt the sandboxes a previous manager left in this state folder; remove what cannot be adopted."""
        points = mounted()
        for d in sorted((self.dir / "sandboxes").iterdir()):
            try:
                sbx = Sandbox(**json.loads((d / "state.json").read_text()))
                if str(d / "merged") not in points:
                    self._mount(sbx)
                if self.cgroup_layout:
                    cg = Cgroup(self.cgroup_layout, sbx.id)
                    if cg.exists():
                        cg.kill()  # commands of the previous manager
                    cg.create(sbx.memory_mb << 20, sbx.pids, sbx.cpus)
                    cg.freeze() if sbx.state == "paused" else cg.thaw()
                self.sandboxes[sbx.id] = sbx
                self.commands[sbx.id] = {}
                self.locks[sbx.id] = threading.Lock()
            except Exception as e:
                log.warning("removing sandbox %s that cannot be recovered: %s", d.name, e)
                self._destroy(d.name)
        self._empty_trash()

    def close(self, kill_all: bool = False) -> None:
        """Stop every running command (sandboxes stay, for the next manager) or, with kill_all, every sandbox."""
        for sid in [s.id for s in self.list()]:
            if kill_all:
                self.kill(sid)
            else:
                for cmd in list(self.commands.get(sid, {}).values()):
                    cmd.kill("manager closed")


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(obj))
    tmp.rename(path)


def _check_env(envs: dict) -> None:
    for k, v in envs.items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k or "\0" in k + v:
            raise SandboxError(f"bad environment variable {k!r}")
