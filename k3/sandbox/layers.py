"""Overlayfs stacks: mount, unmount, flatten layers, hash a tree.

A sandbox's root is `overlay(lower = [newest layer, ..., oldest layer, template], upper, work)`. Layers are
frozen uppers: a snapshot renames the upper into `layers/<id>` (overlayfs' own format: whiteouts are 0:0
character devices, opaque directories carry `trusted.overlay.opaque`), so a snapshot costs an unmount, a
rename and a mount, whatever the sandbox's size. Mounting goes through libc directly (no `mount` process):
the mount and unmount syscalls take well under a millisecond.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import shutil
import stat
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
MNT_DETACH = 2
OPAQUE = "trusted.overlay.opaque"
# index/metacopy/redirect_dir off keep every layer self-contained, so layers can be stacked in any order
# the snapshots record and flattened with plain file operations. volatile: an unmount (every snapshot)
# would otherwise sync the whole host filesystem under the upper, milliseconds to seconds on a busy disk;
# layers reach the disk with the host's normal writeback instead.
OPTIONS = "index=off,metacopy=off,redirect_dir=off,volatile"


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount_overlay(merged: Path, lowers: list[Path], upper: Path, work: Path) -> None:
    """Mount `lowers` (top first) + `upper` on `merged`; `work` must be empty (see `Manager._mount`)."""
    opts = f"lowerdir={':'.join(map(str, lowers))},upperdir={upper},workdir={work},{OPTIONS}"
    # the legacy mount(2) data argument is one page
    if len(opts) >= 4000:
        raise OSError(f"overlay options too long ({len(opts)} bytes): flatten the stack")
    _check(_libc.mount(b"overlay", str(merged).encode(), b"overlay", 0, opts.encode()), f"mount {merged}")


def umount(path: Path, lazy: bool = False) -> None:
    _check(_libc.umount2(str(path).encode(), MNT_DETACH if lazy else 0), f"umount {path}")


def mounted() -> set[str]:
    """Mount points of this mount namespace (octal escapes of mountinfo decoded)."""
    points = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            p = line.split()[4]
            points.add(p.encode().decode("unicode_escape"))
    return points


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _copy_dir_meta(src: Path, dst: Path, st: os.stat_result) -> None:
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    if _opaque(src):
        os.setxattr(dst, OPAQUE, b"y", follow_symlinks=False)


def flatten(layers: list[Path], dest: Path) -> None:
    """Merge `layers` (oldest first) into one new layer `dest` that stacks on the same template.

    Files are hard links into the (immutable) source layers, so flattening copies no data; whiteouts and
    opaque directories are kept, since they still hide template entries.
    """
    dest.mkdir()
    for layer in layers:
        for dirpath, dirnames, filenames in os.walk(layer):
            rel = Path(dirpath).relative_to(layer)
            for name in dirnames + filenames:
                src, dst = Path(dirpath) / name, dest / rel / name
                st = os.lstat(src)
                if stat.S_ISDIR(st.st_mode):
                    if _opaque(src) or not dst.is_dir() or dst.is_symlink():
                        _remove(dst)
                        dst.mkdir()
                    _copy_dir_meta(src, dst, st)
                else:
                    _remove(dst)
                    os.link(src, dst, follow_symlinks=False)


def tree_digest(root: Path) -> tuple[str, int, int]:
    """(sha256, regular files, their bytes) over every entry under `root`: path, type, mode, owner, and the
    content's digest or the link target. Snapshots compare trees by it; templates are addressed by it."""
    h, files, size = hashlib.sha256(), 0, 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            h.update(f"{os.path.relpath(p, root)}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0".encode())
            if stat.S_ISREG(st.st_mode):
                files, size = files + 1, size + st.st_size
                with open(p, "rb") as f:
                    h.update(hashlib.file_digest(f, "sha256").digest())
            elif stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(p).encode())
    return h.hexdigest(), files, size


def tree_hash(root: Path) -> str:
    return tree_digest(root)[0]
