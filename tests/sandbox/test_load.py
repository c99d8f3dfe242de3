"""Load: 64 sandboxes created, used and killed concurrently through the HTTP API, and nothing leaks."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from k3.sandbox.layers import mounted


def _cgroups(manager) -> set:
    if not manager.cgroup_layout:
        return set()
    return {d for p in manager.cgroup_layout.parents.values() for d in p.iterdir() if d.is_dir()}


def test_64_concurrent_sandboxes(client, manager):
    before = (set(manager.sandboxes), {p for p in mounted() if str(manager.dir) in p},
              set(os.listdir(manager.dir / "sandboxes")), _cgroups(manager))

    def life(i: int) -> str:
        sbx = client.create(metadata={"i": str(i)})
        sbx.write_file("/home/user/n", str(i))
        r = sbx.exec("python3 -c \"print(int(open('/home/user/n').read()) ** 2)\"")
        assert sbx.kill()
        return r.stdout

    with ThreadPoolExecutor(64) as pool:
        assert list(pool.map(life, range(64))) == [f"{i * i}\n" for i in range(64)]
    after = (set(manager.sandboxes), {p for p in mounted() if str(manager.dir) in p},
             set(os.listdir(manager.dir / "sandboxes")), _cgroups(manager))
    assert after == before
