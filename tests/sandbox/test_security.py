"""Isolation of backend A (K3 report §5.3.2's threat list, without a VM): network, filesystem, resources and
privileges, each checked from inside a sandbox against what the host sees."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

from k3.sandbox.cgroup import Cgroup


def py(code: str) -> list[str]:
    return ["python3", "-c", code]


# ---- network -----------------------------------------------------------------------------------------------

def test_only_loopback_exists(manager, sbx):
    r = manager.exec(sbx.id, "cat /proc/net/dev")
    ifaces = [line.split(":")[0].strip() for line in r.stdout.splitlines()[2:]]
    assert ifaces == ["lo"], r.stdout


def test_connect_outside_fails_loopback_works(manager, sbx):
    code = """
import socket, errno, threading
out = []
for addr in [("1.1.1.1", 80), ("10.0.0.1", 22), ("8.8.8.8", 53)]:
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect(addr); out.append("connected")
    except OSError as e:
        out.append(errno.errorcode.get(e.errno, str(e)))
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
c = socket.create_connection(srv.getsockname(), timeout=2); c.sendall(b"ping")
print(" ".join(out), srv.accept()[0].recv(4).decode())
"""
    r = manager.exec(sbx.id, py(code))
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split() == ["ENETUNREACH"] * 3 + ["ping"]


# ---- filesystem --------------------------------------------------------------------------------------------

def test_host_paths_invisible(manager, sbx, tmp_path):
    marker = tmp_path / f"host-secret-{uuid.uuid4().hex}"
    marker.write_text("secret")
    paths = [str(marker), str(manager.dir), "/work", "/root/.bashrc", "/etc/shadow", "/sys/fs/cgroup/memory",
             "/var/lib", os.path.dirname(__file__)]
    code = "import os, sys; print([p for p in sys.argv[1:] if os.path.exists(p)])"
    r = manager.exec(sbx.id, ["python3", "-c", code, *paths])
    assert r.stdout.strip() == "[]", r.stdout


def test_writes_never_reach_template_or_host(manager, sbx):
    template = manager.templates.root(sbx.template)
    before = sorted(os.listdir(template / "tmp")), (template / "etc/hostname").read_text()
    name = f"w-{uuid.uuid4().hex}"
    r = manager.exec(sbx.id, f"echo x > /tmp/{name} && echo y > ~/{name} && rm -f /usr/bin/cmp; "
                             f"echo z > /etc/hostname; echo $?")
    assert r.stdout.strip() == "2" or "Permission denied" in r.stderr
    manager.write_file(sbx.id, "/etc/hostname", "changed by the API\n")  # the manager may; it lands in the upper
    assert manager.read_file(sbx.id, "/etc/hostname") == b"changed by the API\n"
    assert (sorted(os.listdir(template / "tmp")), (template / "etc/hostname").read_text()) == before
    assert (template / "usr/bin/cmp").exists()
    assert not os.path.exists(f"/tmp/{name}") and Path("/etc/hostname").read_text() != "changed by the API\n"
    other = manager.create()
    try:
        assert manager.exec(other.id, f"ls /tmp/{name} ~/{name} 2>&1; cat /etc/hostname").stdout.count(
            "No such file") == 2
    finally:
        manager.kill(other.id)


def test_dotdot_and_symlink_escapes_stay_inside(manager, sbx):
    host_secret = f"/root/k3-escape-{uuid.uuid4().hex}"
    assert manager.read_file(sbx.id, "../../../../../etc/hostname") == b"sandbox\n"
    with pytest.raises(FileNotFoundError):
        manager.read_file(sbx.id, "/../../etc/shadow")  # exists on the host, not in the sandbox
    r = manager.exec(sbx.id, "ln -s / ~/up && ln -s /etc/hostname ~/h && ln -s ../../../../../../../root ~/r && "
                             "mkfifo ~/fifo && echo ok")
    assert r.stdout.strip() == "ok", r.stderr
    assert manager.read_file(sbx.id, "/home/user/h") == b"sandbox\n"
    manager.write_file(sbx.id, f"/home/user/up{host_secret}", "through a symlink")
    manager.write_file(sbx.id, f"/home/user/r/{os.path.basename(host_secret)}-2", "through ..")
    assert not os.path.exists(host_secret) and not os.path.exists(host_secret + "-2")
    assert manager.read_file(sbx.id, host_secret) == b"through a symlink"
    with pytest.raises(ValueError, match="not a regular file"):
        manager.read_file(sbx.id, "/home/user/fifo")  # would block a naive reader forever


# ---- resources ---------------------------------------------------------------------------------------------

def _empty_soon(cgroup: Cgroup, seconds: float = 5.0) -> bool:
    """The kernel tears a pid namespace down asynchronously: its processes leave the cgroup within moments."""
    deadline = time.monotonic() + seconds
    while cgroup.pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not cgroup.pids()


@pytest.mark.cgroups
def test_memory_limit_kills(manager):
    s = manager.create(memory_mb=64)
    try:
        r = manager.exec(s.id, py("x = bytearray(200 << 20); print('survived')"))
        assert r.exit_code == 137 and "survived" not in r.stdout, r
        assert manager.exec(s.id, "echo alive").stdout == "alive\n"
    finally:
        manager.kill(s.id)


@pytest.mark.cgroups
def test_fork_bomb_stops_at_pids_limit(manager):
    s = manager.create(pids=40)
    code = """
import os, time
n = 0
while True:
    try:
        pid = os.fork()
    except OSError as e:
        print(n, e.errno); break
    if pid == 0:
        time.sleep(30); os._exit(0)
    n += 1
"""
    try:
        t = time.monotonic()
        r = manager.exec(s.id, py(code), timeout=20)
        n, err = map(int, r.stdout.split())
        assert err == 11 and 20 < n < 40, r  # EAGAIN at pids.max
        assert time.monotonic() - t < 15
        assert _empty_soon(Cgroup(manager.cgroup_layout, s.id))  # the children went with the pid namespace
    finally:
        manager.kill(s.id)


@pytest.mark.cgroups
def test_cpu_quota_holds(manager):
    s = manager.create(cpus=0.2)
    code = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass\nprint(time.process_time())"
    try:
        used = float(manager.exec(s.id, py(code)).stdout)
        assert used < 0.2 * 1.5 + 0.15, used  # quota, plus a period of slack
    finally:
        manager.kill(s.id)


@pytest.mark.cgroups
def test_timeout_reaps_the_whole_group(manager, sbx):
    t = time.monotonic()
    r = manager.exec(sbx.id, "sleep 100 & (sleep 100 &) ; setsid sleep 100 & sleep 100", timeout=1)
    assert r.error == "timeout" and r.exit_code == 137
    assert time.monotonic() - t < 5
    assert _empty_soon(Cgroup(manager.cgroup_layout, sbx.id))


def test_background_processes_do_not_outlive_their_command(manager, sbx):
    manager.exec(sbx.id, "(sleep 100 &); nohup sleep 100 >/dev/null 2>&1 & echo started")
    assert manager.exec(sbx.id, "ps -e -o comm= | grep -c sleep || true").stdout.strip() == "0"


# ---- privilege ---------------------------------------------------------------------------------------------

def test_no_capabilities(manager, sbx):
    r = manager.exec(sbx.id, "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs' /proc/self/status; id -u")
    lines = r.stdout.split("\n")
    assert all(line.split()[1] == "0000000000000000" for line in lines[:5]), r.stdout
    assert lines[5].split() == ["NoNewPrivs:", "1"] and lines[6] == "1000"


def test_mount_unshare_ptrace_fail(manager, sbx):
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def call(f, *a):
    return f(*a), ctypes.get_errno()
print(call(libc.mount, b"none", b"/tmp", b"tmpfs", 0, None)[0],
      call(libc.unshare, 0x10000000)[0],         # CLONE_NEWUSER
      call(libc.unshare, 0x00020000)[0],         # CLONE_NEWNS
      call(libc.ptrace, 16, {os.getpid()}, 0, 0)[0],  # PTRACE_ATTACH to the manager's host pid
      os.path.exists("/proc/{os.getpid()}/environ") and {os.getpid()} > 1000)
"""
    r = manager.exec(sbx.id, py(code))
    assert r.stdout.split() == ["-1", "-1", "-1", "-1", "False"], (r.stdout, r.stderr)


def test_setuid_binaries_do_not_elevate(manager, sbx):
    # planted from the host, as root: a setuid-root copy of `id`
    dst = manager._merged(sbx.id) / "usr/local/bin/suid-id"
    shutil.copy2("/usr/bin/id", dst)
    os.chown(dst, 0, 0)
    os.chmod(dst, 0o4755)
    r = manager.exec(sbx.id, "ls -l /usr/local/bin/suid-id; /usr/local/bin/suid-id -u; /usr/local/bin/suid-id -ru")
    assert r.stdout.split("\n")[1:3] == ["1000", "1000"], r
