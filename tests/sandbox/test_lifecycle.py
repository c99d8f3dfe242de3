"""Lifecycle of backend A: exec and streaming, snapshot/restore, fork, pause/resume, timeouts, kill, layer
flattening and a manager restart on the same state folder."""

from __future__ import annotations

import json
import os
import time

import pytest

from k3.sandbox import Manager, SandboxConfig, SandboxError
from k3.sandbox.cgroup import Cgroup
from k3.sandbox.layers import mounted, umount
from k3.sandbox.manager import Busy, NotFound, NotRunning


def test_exec_result_fields(manager, sbx):
    r = manager.exec(sbx.id, "echo out; echo err >&2; exit 7")
    assert (r.stdout, r.stderr, r.exit_code, r.error) == ("out\n", "err\n", 7, None)
    assert 0 < r.duration < 5
    r = manager.exec(sbx.id, ["python3", "-c", "import os, sys; print(os.getcwd(), os.environ['A'], sys.argv[1])",
                              "arg with spaces"], envs={"A": "1"}, cwd="/tmp")
    assert r.stdout == "/tmp 1 arg with spaces\n"
    with pytest.raises(SandboxError, match="does not exist"):
        manager.exec(sbx.id, "true", cwd="/nope")


def test_exec_streams_output_as_it_comes(manager, sbx):
    cmd = manager.start(sbx.id, "for i in 1 2 3; do echo $i; sleep 0.2; done")
    t0, seen = time.monotonic(), []
    for stream, data in cmd.stream():
        seen.append((round(time.monotonic() - t0, 1), stream, data))
    assert [d for _, _, d in seen] == [b"1\n", b"2\n", b"3\n"]
    assert seen[0][0] < 0.2 and seen[-1][0] >= 0.35  # the first line came before the command ended
    assert cmd.exit_code == 0


def test_sandbox_envs_and_command_envs(manager):
    s = manager.create(envs={"A": "sandbox", "B": "sandbox"})
    try:
        assert manager.exec(s.id, "echo $A $B", envs={"B": "command"}).stdout == "sandbox command\n"
    finally:
        manager.kill(s.id)


def test_snapshot_restore_gives_identical_tree(manager, sbx):
    manager.exec(sbx.id, "mkdir -p ~/proj && echo v1 > ~/proj/a && echo keep > /tmp/k && rm /usr/bin/cmp 2>/dev/null; "
                         "ln -s a ~/proj/link; chmod 600 ~/proj/a")
    before = manager.tree_hash(sbx.id)
    snap = manager.snapshot(sbx.id)
    assert manager.tree_hash(sbx.id) == before  # sealing changes nothing visible
    manager.exec(sbx.id, "echo v2 > ~/proj/a && rm /tmp/k && rm -r ~/proj/link && echo new > ~/new")
    assert manager.tree_hash(sbx.id) != before
    manager.restore(sbx.id, snap)
    assert manager.tree_hash(sbx.id) == before
    assert manager.exec(sbx.id, "cat ~/proj/a /tmp/k; ls ~").stdout == "v1\nkeep\nproj\n"
    assert snap in [i["id"] for i in manager.snapshots(sbx.id)]


def test_snapshots_are_incremental_layers(manager, sbx):
    manager.exec(sbx.id, "head -c 1000000 /dev/zero > ~/big")
    first = manager.snapshot(sbx.id)
    manager.exec(sbx.id, "echo small > ~/small")
    second = manager.snapshot(sbx.id)
    layer = manager.dir / "layers" / second
    assert sorted(p.name for p in (layer / "home/user").iterdir()) == ["small"]  # only what changed
    assert manager.get(sbx.id).layers == [second, first]
    assert manager.snapshot(sbx.id) == second  # nothing changed: no new layer
    other = manager.create(template=first)  # a new sandbox from a snapshot
    try:
        assert manager.exec(other.id, "ls ~").stdout == "big\n"
    finally:
        manager.kill(other.id)


def test_forks_are_independent(manager, sbx):
    manager.exec(sbx.id, "echo base > ~/f")
    kids = manager.fork(sbx.id, 3)
    try:
        assert len({k.id for k in kids} | {sbx.id}) == 4
        for i, k in enumerate(kids):
            manager.exec(k.id, f"echo child{i} >> ~/f")
        manager.exec(sbx.id, "echo parent >> ~/f")
        assert manager.read_file(sbx.id, "~/f".replace("~", "/home/user")) == b"base\nparent\n"
        for i, k in enumerate(kids):
            assert manager.read_file(k.id, "/home/user/f") == f"base\nchild{i}\n".encode()
        manager.kill(kids[0].id)
        assert manager.exec(kids[1].id, "cat ~/f").stdout == "base\nchild1\n"
    finally:
        for k in kids:
            if k.id in manager.sandboxes:
                manager.kill(k.id)


def test_snapshot_needs_an_idle_sandbox(manager, sbx):
    cmd = manager.start(sbx.id, "sleep 5")
    with pytest.raises(Busy):
        manager.snapshot(sbx.id)
    cmd.kill()
    list(cmd.stream())
    cmd.done.wait(5)
    time.sleep(0.05)
    manager.snapshot(sbx.id)


@pytest.mark.cgroups
def test_pause_stops_progress_and_resume_continues(manager, sbx):
    # written then renamed, so a read never sees a half-written counter
    loop = "i=0; while true; do i=$((i+1)); echo $i > /tmp/m; mv /tmp/m /tmp/n; sleep 0.02; done"
    cmd = manager.start(sbx.id, loop, timeout=30)
    time.sleep(0.3)
    assert manager.pause(sbx.id) and not manager.pause(sbx.id)
    with pytest.raises(NotRunning):
        manager.exec(sbx.id, "true")
    counter = manager._merged(sbx.id) / "tmp/n"  # read from the host: the data plane refuses a paused sandbox
    n1 = int(counter.read_text())
    time.sleep(0.4)
    assert int(counter.read_text()) == n1
    assert manager.resume(sbx.id) and not manager.resume(sbx.id)
    time.sleep(0.3)
    assert int(manager.read_file(sbx.id, "/tmp/n")) > n1
    cmd.kill()
    list(cmd.stream())


@pytest.mark.cgroups
def test_sandbox_timeouts_kill_or_pause(manager):
    killed = manager.create(timeout=0.3)
    paused = manager.create(timeout=0.3, auto_pause=True)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (killed.id in manager.sandboxes or manager.get(paused.id).state != "paused"):
        manager.reap()  # or the server's reaper, when it runs
        time.sleep(0.05)
    assert killed.id not in manager.sandboxes
    assert manager.get(paused.id).state == "paused"
    manager.resume(paused.id, timeout=60)
    assert manager.exec(paused.id, "echo back").stdout == "back\n"
    manager.kill(paused.id)


def test_kill_leaves_nothing(manager):
    s = manager.create()
    manager.exec(s.id, "echo x > ~/x")
    cmd = manager.start(s.id, "sleep 60 & sleep 60")
    time.sleep(0.1)
    d = manager._dir(s.id)
    manager.kill(s.id)
    list(cmd.stream())
    assert not d.exists() and str(d / "merged") not in mounted()
    if manager.cgroup_layout:
        assert not any(p.exists() for p in Cgroup(manager.cgroup_layout, s.id).dirs.values())
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _in_sandbox(int(p), d)]
    with pytest.raises(NotFound):
        manager.kill(s.id)


def _in_sandbox(pid: int, folder) -> bool:
    try:
        return str(folder) in os.readlink(f"/proc/{pid}/root") or str(folder) in open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return False


def test_deep_stacks_are_flattened(fresh_state):
    m = Manager(SandboxConfig(state_dir=fresh_state, max_layers=3))
    s = m.create()
    try:
        snaps = []
        for i in range(5):
            m.exec(s.id, f"echo {i} > ~/f{i}; rm -f ~/f{i - 2}; mkdir -p ~/d{i}; rm -rf ~/d{i - 1}")
            snaps.append(m.snapshot(s.id))
        want = m.tree_hash(s.id)
        deadline = time.monotonic() + 20
        while len(m.get(s.id).layers) > 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        merged = m.get(s.id).layers[-1]
        assert len(m.get(s.id).layers) <= 3
        assert json.loads((m.dir / "layers" / f"{merged}.json").read_text())["kind"] == "merged"
        assert m.tree_hash(s.id) == want
        assert m.exec(s.id, "ls ~").stdout.split() == ["d4", "f3", "f4"]
        m.restore(s.id, snaps[1])  # older snapshots keep their own stacks
        assert m.exec(s.id, "ls ~").stdout.split() == ["d1", "f0", "f1"]
        m.flattening.add(s.id)  # as when snapshots outrun the background flattening
        for i in range(7):
            m.exec(s.id, f"echo {i} > ~/g{i}")
            snaps.append(m.snapshot(s.id))
        assert len(m.get(s.id).layers) < 2 * 3 + 1
        assert m.exec(s.id, "ls ~").stdout.split() == ["d1", "f0", "f1"] + [f"g{i}" for i in range(7)]
    finally:
        m.kill(s.id)
        for snap in snaps:
            m.delete_snapshot(snap)


def test_state_survives_a_manager_restart(fresh_state):
    m1 = Manager(SandboxConfig(state_dir=fresh_state))
    a, b = m1.create(metadata={"who": "a"}), m1.create()
    m1.exec(a.id, "echo kept > ~/kept")
    m1.snapshot(a.id)
    if m1.cgroup_layout:
        m1.pause(b.id)
    broken = fresh_state / "sandboxes" / "ibroken"
    (broken / "merged").mkdir(parents=True)
    (broken / "state.json").write_text("{not json")
    del m1  # as after a crash of the manager process: mounts, cgroups and files stay
    umount(fresh_state / "sandboxes" / b.id / "merged")  # as after a reboot: b must be mounted again

    m2 = Manager(SandboxConfig(state_dir=fresh_state))
    assert {s.id for s in m2.list()} == {a.id, b.id}
    assert m2.get(a.id).metadata == {"who": "a"} and len(m2.get(a.id).layers) == 1
    assert m2.exec(a.id, "cat ~/kept").stdout == "kept\n"
    assert not broken.exists()
    if m2.cgroup_layout:
        assert m2.get(b.id).state == "paused"
        m2.resume(b.id)
    assert m2.exec(b.id, "echo remounted").stdout == "remounted\n"
    for sid in (a.id, b.id):
        m2.kill(sid)
        assert str(fresh_state / "sandboxes" / sid / "merged") not in mounted()
    umount_all = Manager(SandboxConfig(state_dir=fresh_state))
    assert umount_all.list() == []
