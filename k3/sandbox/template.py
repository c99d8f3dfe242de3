"""Templates: read-only root filesystems, content-addressed and cached under `<state>/templates/`.

`build_host_template` makes the default one ("base") offline from this Debian host: the shell, coreutils and
a few text tools, this host's `python3` with its standard library, every shared library they load (found with
`ldd`), and a small `/etc` (users `root` and `user`, home `/home/user`, `PATH`, `C.UTF-8`). Files are copied,
not bound, so a host upgrade never changes a template under a running sandbox, and the id is the sha256 of the
tree: path, type, mode, owner and content of every entry. `build_dir_template` takes any root folder instead
(a debootstrap'd Debian, an unpacked container image). Names map to ids in `aliases.json`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import uuid
from pathlib import Path

from k3.sandbox.layers import tree_digest

# what a code task needs: a shell (bash for E2B's `bash -l -c`), coreutils, text tools, Python
PROGRAMS = """bash dash sh env ls cat cp mv rm mkdir rmdir ln chmod chown touch echo printf head tail wc sort uniq cut
tr tee sleep true false test [ date basename dirname pwd readlink realpath stat id whoami uname seq yes grep sed
awk find xargs diff cmp tar gzip gunzip timeout kill ps nproc du df md5sum sha256sum base64 mktemp patch which
nice env expr od hostname mkfifo dd tac paste comm join fold nl truncate shuf install split sha1sum""".split()
SKIP_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "site-packages", "dist-packages"}
MOUNT_POINTS = ("proc", "dev", "sys", "run", "tmp", "var/tmp", "root", "home/user", "usr/local/bin")
USER_UID = 1000
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # `user` inside every sandbox, as in E2B's templates

ETC = {
    "passwd": "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000:user:/home/user:/bin/bash\n"
              "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost\n::1 localhost ip6-localhost\n",
    "hostname": "sandbox\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    # a login shell (E2B runs `bash -l -c`) must keep a PATH the caller passed
    "profile": 'export PATH="${PATH:-/usr/local/bin:/usr/bin:/bin}"\nexport LANG="${LANG:-C.UTF-8}"\n',
}


class Templates:
    """The template cache of one state folder: `<id>/root`, `<id>/manifest.json`, and `aliases.json`."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def _aliases(self) -> dict[str, str]:
        f = self.folder / "aliases.json"
        return json.loads(f.read_text()) if f.exists() else {}

    def resolve(self, name: str) -> str | None:
        """Template id for an alias or an id (or a unique id prefix); None when unknown."""
        if not NAME.fullmatch(name):
            return None
        if name in self._aliases():
            return self._aliases()[name]
        matches = [p.name for p in self.folder.glob(f"{name}*") if (p / "manifest.json").exists()]
        return matches[0] if len(matches) == 1 else None

    def root(self, template_id: str) -> Path:
        return self.folder / template_id / "root"

    def list(self) -> list[dict]:
        aliases = self._aliases()
        out = []
        for m in sorted(self.folder.glob("*/manifest.json")):
            info = json.loads(m.read_text())
            out.append({"templateID": m.parent.name, "aliases": [a for a, t in aliases.items() if t == m.parent.name],
                        "files": info["files"], "bytes": info["bytes"], "source": info["source"]})
        return out

    def add(self, staging: Path, name: str, source: str) -> str:
        """Hash `staging`, move it into the cache (or drop it when that id is cached) and alias it `name`."""
        digest, files, size = tree_digest(staging)
        template_id = digest[:16]
        dest = self.folder / template_id
        if (dest / "manifest.json").exists():
            shutil.rmtree(staging)
        else:
            dest.mkdir(exist_ok=True)
            staging.rename(dest / "root")
            (dest / "manifest.json").write_text(json.dumps({"sha256": digest, "files": files, "bytes": size,
                                                            "source": source}, indent=1))
        aliases = self._aliases() | {name: template_id}
        tmp = self.folder / f".aliases-{uuid.uuid4().hex}"
        tmp.write_text(json.dumps(aliases, indent=1))
        tmp.rename(self.folder / "aliases.json")
        return template_id

    def staging(self) -> Path:
        return Path(tempfile.mkdtemp(prefix=".build-", dir=self.folder))


def _add_host_path(root: Path, path: str) -> None:
    """Copy host `path` into `root` at the same place, following symlinks as symlinks (parents resolved)."""
    parent = os.path.realpath(os.path.dirname(path))
    path = os.path.join(parent, os.path.basename(path))
    dst = Path(str(root) + path)
    if os.path.lexists(dst) or not os.path.lexists(path):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    if os.path.islink(path):
        target = os.readlink(path)
        os.symlink(target, dst)
        _add_host_path(root, os.path.normpath(os.path.join(parent, target)))
    elif os.path.isdir(path):
        shutil.copytree(path, dst, symlinks=True, ignore=shutil.ignore_patterns(*SKIP_STDLIB))
    else:
        shutil.copy2(path, dst)


def _shared_libraries(files: list[str]) -> set[str]:
    out = subprocess.run(["ldd", *files], capture_output=True, text=True).stdout
    libs = set()
    for line in out.splitlines():
        for token in line.replace("=>", " ").split():
            if token.startswith("/") and not token.endswith(":"):
                libs.add(token)
    return libs


def _is_elf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def _finish_root(root: Path, user_uid: int, user_gid: int) -> None:
    """Mount points, `/tmp` modes and the home of `user` (owned by the host uid that runs sandboxes)."""
    os.chmod(root, 0o755)
    for d in MOUNT_POINTS:
        (root / d).mkdir(parents=True, exist_ok=True)
    for d in ("tmp", "var/tmp"):
        os.chmod(root / d, 0o1777)
    os.chmod(root / "root", 0o700)
    os.chown(root / "home/user", user_uid, user_gid)
    os.chmod(root / "home/user", 0o755)


def build_host_template(templates: Templates, user_uid: int, user_gid: int, name: str = "base") -> str:
    """The default template from this host's programs and Python (see the module docstring)."""
    python = os.path.realpath(shutil.which("python3", path="/usr/bin:/bin") or sys.executable)
    stdlib = sysconfig.get_paths()["stdlib"] if python == os.path.realpath(sys.executable) else \
        subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
                       capture_output=True, text=True, check=True).stdout.strip()
    root = templates.staging()
    for link, target in (("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
        if os.path.islink(f"/{link}"):
            (root / "usr" / link).mkdir(parents=True, exist_ok=True)
            os.symlink(target, root / link)
    programs = [p for p in (shutil.which(n, path="/usr/bin:/bin:/usr/sbin:/sbin") for n in PROGRAMS) if p]
    if python.startswith("/usr/"):
        programs += [python, "/usr/bin/python3"] if os.path.exists("/usr/bin/python3") else [python]
        _add_host_path(root, stdlib)
    else:
        # a Python outside /usr (pyenv, conda) goes to /usr/local, where it finds its standard library by the
        # same relative path; its own prefix may be unreadable to the sandbox user (e.g. under /root)
        version = os.path.basename(stdlib)
        (root / "usr/local/bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(python, root / "usr/local/bin" / version)
        os.symlink(version, root / "usr/local/bin/python3")
        shutil.copytree(stdlib, root / "usr/local/lib" / version, symlinks=True,
                        ignore=shutil.ignore_patterns(*SKIP_STDLIB))
    for p in programs:
        _add_host_path(root, p)
    dynload = [str(p) for p in Path(stdlib, "lib-dynload").glob("*.so")]
    elves = [os.path.realpath(p) for p in programs + [python] if _is_elf(os.path.realpath(p))] + dynload
    for lib in _shared_libraries(elves):
        if lib.startswith(("/usr/", "/lib")):
            _add_host_path(root, lib)
        else:  # e.g. a pyenv libpython: into the loader's default search path
            shutil.copy2(lib, root / "usr/lib" / os.path.basename(lib))
    etc = root / "etc"
    etc.mkdir(exist_ok=True)
    for f, text in ETC.items():
        (etc / f).write_text(text)
    for f in ("ld.so.cache", "os-release"):
        if os.path.exists(f"/etc/{f}"):
            shutil.copy2(os.path.realpath(f"/etc/{f}"), etc / f)
    os.symlink("/proc/self/mounts", etc / "mtab")
    _finish_root(root, user_uid, user_gid)
    return templates.add(root, name, f"host: {len(programs)} programs, python {python}")


def build_dir_template(templates: Templates, src: Path, name: str, user_uid: int, user_gid: int) -> str:
    """A template from a root folder `src` (it must hold /bin/sh; E2B's SDK also needs /bin/bash)."""
    if not (src / "bin" / "sh").exists() and not (src / "usr" / "bin" / "sh").exists():
        raise ValueError(f"{src} is not a root filesystem: no /bin/sh")
    root = templates.staging()
    root.rmdir()
    shutil.copytree(src, root, symlinks=True)
    _finish_root(root, user_uid, user_gid)
    return templates.add(root, name, f"directory {src}")
