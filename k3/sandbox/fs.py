"""File operations on a sandbox's root from the (root) manager, confined to that root.

The manager reads and writes the merged overlay directly, as root, so every path is resolved by the kernel
with `openat2(RESOLVE_IN_ROOT)`: `..` stops at the sandbox root and a symlink to `/etc/shadow` means the
sandbox's own `/etc/shadow`, whatever a process inside changes between two calls. Only the last component is
then touched through a `*at` call on the resolved parent. Files are opened non-blocking and must be regular
(a FIFO planted in the sandbox cannot hang the manager); new files and folders belong to the sandbox user.
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import shutil
import stat
from dataclasses import dataclass

_libc = ctypes.CDLL(None, use_errno=True)
SYS_OPENAT2 = 437  # x86_64 and aarch64
RESOLVE_NO_XDEV, RESOLVE_NO_MAGICLINKS, RESOLVE_IN_ROOT = 0x01, 0x02, 0x10
HOME = "/home/user"


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2(root_fd: int, rel: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)
    fd = _libc.syscall(SYS_OPENAT2, root_fd, (rel or ".").encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), "/" + rel)
    return fd


def sandbox_path(path: str) -> str:
    """Absolute, normalized sandbox path; relative paths start at the user's home (as in E2B)."""
    if "\0" in path:
        raise ValueError("path contains a NUL byte")
    return posixpath.normpath(posixpath.join(HOME, path or HOME)).replace("//", "/")


@dataclass
class Entry:
    name: str
    path: str  # absolute inside the sandbox
    type: str  # file | dir | symlink | other
    size: int
    mode: int
    uid: int
    gid: int
    mtime: float
    symlink_target: str | None = None


class Root:
    """A sandbox root folder on the host; `uid`/`gid` own what the manager creates in it."""

    def __init__(self, folder: str, uid: int, gid: int):
        self.folder, self.uid, self.gid = folder, uid, gid

    def __enter__(self):
        self.fd = os.open(self.folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)

    def _open(self, path: str, flags: int, mode: int = 0) -> int:
        return _openat2(self.fd, sandbox_path(path).lstrip("/"), flags, mode)

    def _parent(self, path: str) -> tuple[int, str]:
        """(fd of the resolved parent folder, last component) of `path`."""
        p = sandbox_path(path)
        if p == "/":
            raise PermissionError(errno.EPERM, "the sandbox root itself", "/")
        return self._open(posixpath.dirname(p), os.O_PATH | os.O_DIRECTORY), posixpath.basename(p)

    def read(self, path: str, max_bytes: int) -> bytes:
        fd = self._open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", sandbox_path(path))
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{sandbox_path(path)} is not a regular file")
            if st.st_size > max_bytes:
                raise OverflowError(f"{sandbox_path(path)} has {st.st_size} bytes, over the {max_bytes} limit")
            chunks, total = [], 0
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
                total += len(chunk)
                if total > max_bytes:
                    raise OverflowError(f"{sandbox_path(path)} grew over the {max_bytes} byte limit")
            return b"".join(chunks)
        finally:
            os.close(fd)

    def make_dirs(self, path: str) -> bool:
        """Create `path` and its missing parents (owned by the sandbox user); False if it already existed."""
        p = sandbox_path(path)
        created = False
        for i in range(2, len(p.split("/")) + 1):
            prefix = "/".join(p.split("/")[:i])
            try:
                os.close(self._open(prefix, os.O_PATH | os.O_DIRECTORY))
                continue
            except FileNotFoundError:
                pass
            parent, name = self._parent(prefix)
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
                os.chown(name, self.uid, self.gid, dir_fd=parent, follow_symlinks=False)
                created = True
            finally:
                os.close(parent)
        return created

    def write(self, path: str, data: bytes) -> str:
        p = sandbox_path(path)
        self.make_dirs(posixpath.dirname(p))
        try:
            fd = self._open(p, os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK)
        except FileNotFoundError:
            fd = self._open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            os.fchown(fd, self.uid, self.gid)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{p} is not a regular file")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        return p

    def entry(self, path: str) -> Entry:
        p = sandbox_path(path)
        if p == "/":
            return _entry("/", "/", os.stat(self.folder), None)
        parent, name = self._parent(p)
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            target = os.readlink(name, dir_fd=parent) if stat.S_ISLNK(st.st_mode) else None
        finally:
            os.close(parent)
        return _entry(name, p, st, target)

    def list(self, path: str, depth: int = 1) -> list[Entry]:
        p = sandbox_path(path)
        fd = self._open(p, os.O_RDONLY | os.O_DIRECTORY)
        try:
            out = []
            with os.scandir(fd) as it:
                for e in sorted(it, key=lambda e: e.name):
                    st = e.stat(follow_symlinks=False)
                    target = os.readlink(e.name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else None
                    out.append(_entry(e.name, posixpath.join(p, e.name), st, target))
        finally:
            os.close(fd)
        if depth > 1:
            for e in list(out):
                if e.type == "dir":
                    out += self.list(e.path, depth - 1)
        return out

    def remove(self, path: str) -> None:
        parent, name = self._parent(path)
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=parent)
            else:
                os.unlink(name, dir_fd=parent)
        finally:
            os.close(parent)

    def move(self, src: str, dst: str) -> str:
        self.make_dirs(posixpath.dirname(sandbox_path(dst)))
        sp, sname = self._parent(src)
        dp, dname = self._parent(dst)
        try:
            os.rename(sname, dname, src_dir_fd=sp, dst_dir_fd=dp)
        finally:
            os.close(sp)
            os.close(dp)
        return sandbox_path(dst)

    def is_dir(self, path: str) -> bool:
        try:
            os.close(self._open(path, os.O_PATH | os.O_DIRECTORY))
            return True
        except OSError:
            return False


def _entry(name: str, path: str, st: os.stat_result, target: str | None) -> Entry:
    kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
            else "symlink" if stat.S_ISLNK(st.st_mode) else "other")
    return Entry(name, path, kind, st.st_size, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime, target)
