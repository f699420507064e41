"""Files in a folder the server owns, reached through the folder's descriptor: never through a
symlink, read whole, written atomically (temp file, fsync, rename, fsync the folder), so a file
is complete or absent (docs/ARCHITECTURE.md, invariant 5)."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

TMP_PREFIX = ".tmp."  # a file named so is a write a crash cut short
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_NO_LINK = (errno.ELOOP, errno.EMLINK, errno.ENXIO)  # a symlink, or a FIFO opened non-blocking


class UnsafeFile(ValueError):
    """A name that is a symlink or no regular file, too large, or cut short while read."""


def open_folder(path: Path) -> int:
    """The descriptor of folder ``path`` (made, private, when missing), not through a symlink."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW)


def read_file(folder: int, name: str, limit: int) -> bytes:
    """The whole of regular file ``name`` in ``folder``; :class:`UnsafeFile` for a symlink, a
    special file, more than ``limit`` bytes, or a file that ends before its size."""
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _NOFOLLOW, dir_fd=folder)
    except OSError as e:
        if e.errno in _NO_LINK:
            raise UnsafeFile("a symlink or special file, not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile("not a regular file")
        if st.st_size > limit:
            raise UnsafeFile(f"{st.st_size} bytes, more than the {limit} allowed")
        data = bytearray()
        while len(data) < st.st_size:
            chunk = os.pread(fd, st.st_size - len(data), len(data))
            if not chunk:
                raise UnsafeFile("truncated while reading")
            data += chunk
        return bytes(data)
    finally:
        os.close(fd)


def write_file(folder: int, name: str, data: bytes) -> None:
    """``name`` in ``folder`` holding ``data``, atomically: written to a temp file that is
    flushed to the disk and renamed over ``name``, then the folder flushed; on an error the temp
    file is removed and the error raised."""
    tmp = f"{TMP_PREFIX}{os.getpid()}.{secrets.token_hex(6)}.{name}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=folder)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            _flush(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        remove(folder, tmp)
        raise
    try:
        _flush(folder)
    except OSError:  # some file systems refuse to flush a folder; the rename holds
        pass


def remove(folder: int, name: str) -> None:
    """``name`` gone from ``folder`` (a symlink itself, never its target), if it can be."""
    try:
        os.unlink(name, dir_fd=folder)
    except OSError:
        pass


def _flush(fd: int) -> None:
    """To stable storage: macOS's F_FULLFSYNC (its fsync leaves the drive's cache), else fsync."""
    if fcntl is not None and hasattr(fcntl, "F_FULLFSYNC"):
        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass
    os.fsync(fd)
