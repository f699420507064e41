"""File-system primitives of the disk store: directories and files opened without following
symlinks, exact reads, and atomic writes (temp file, fsync, rename, directory fsync), so a file
is either complete or absent (docs/ARCHITECTURE.md, invariant 5)."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Callable, Sequence

from kv_cache.errors import FormatError

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

TMP_PREFIX = ".tmp."
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
IOV_MAX = 1024  # buffers one preadv may take (Linux and macOS)


def open_dir(name: str, dir_fd: int | None, create: bool) -> int:
    """A directory fd, never through a symlink. With ``create``, a missing directory is made and
    a symlink or file planted in its place is removed first (it is inside our tree)."""
    flags = os.O_RDONLY | _DIRECTORY | NOFOLLOW | CLOEXEC
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as e:
        if not create or e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise
        os.unlink(name, dir_fd=dir_fd)
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        pass
    return os.open(name, flags, dir_fd=dir_fd)


def open_regular(name: str, dir_fd: int) -> tuple[int, int]:
    """(fd, size) of a regular file opened without following a symlink (nor blocking on a FIFO)."""
    try:
        fd = os.open(name, os.O_RDONLY | NOFOLLOW | NONBLOCK | CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK, errno.ENXIO):
            raise FormatError("a symlink or special file, not followed") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FormatError("not a regular file")
    return fd, st.st_size


def read_at(fd: int, n: int, offset: int) -> bytes:
    """Exactly ``n`` bytes at ``offset``; fewer means the file was truncated."""
    parts, got = [], 0
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            raise FormatError("truncated while reading")
        parts.append(b)
        got += len(b)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_into(fd: int, buf: memoryview | Sequence[memoryview], offset: int) -> None:
    """Fill ``buf`` (writable bytes, or several buffers one after another) from ``offset``;
    a short file is truncated."""
    bufs = [buf] if isinstance(buf, memoryview) else list(buf)
    i = 0
    while i < len(bufs):
        k = os.preadv(fd, bufs[i : i + IOV_MAX], offset)
        if not k:
            raise FormatError("truncated while reading")
        offset += k
        while i < len(bufs) and k >= bufs[i].nbytes:
            k -= bufs[i].nbytes
            i += 1
        if k:
            bufs[i] = bufs[i][k:]


def read_all(fd: int, size: int) -> bytes:
    """The whole file (size from fstat); checked again by the caller."""
    return read_at(fd, size, 0)


def fsync_file(fd: int) -> None:
    """Flush to stable storage: F_FULLFSYNC where the platform has it (macOS), else fsync."""
    full = getattr(fcntl, "F_FULLFSYNC", None)
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError:
            pass
    os.fsync(fd)


def atomic_write(dir_fd: int, name: str, chunks: Sequence, mtime_ns: int | None = None) -> int:
    """Write ``name`` in ``dir_fd`` atomically: temp file, fsync, rename, fsync the directory.
    Returns the size written. On any error the temp file is removed and the error re-raised."""
    sizes: list[int] = []
    atomic_write_many([(dir_fd, name, chunks, mtime_ns)], lambda i, n: sizes.append(n))
    return sizes[0]


def atomic_write_many(files: Sequence[tuple[int, str, Sequence, int | None]],
                      done: Callable[[int, int], None]) -> None:
    """Write several files ``(dir_fd, name, chunks, mtime_ns)``, each complete or absent.

    Each goes to a temp file that is fsynced; the last one gets the full flush (F_FULLFSYNC on
    macOS empties the drive's cache, which makes every earlier fsync durable too: one costly
    flush per batch, not per file); then each is renamed, ``done(index, size)`` called, and
    every directory fsynced (the last with a full flush). On an error the temp files not yet
    renamed are removed and the error re-raised; the caller learns what landed from ``done``.
    """
    pending: list[tuple[int, str, str, int]] = []  # dir_fd, temp name, name, size
    try:
        for i, (dir_fd, name, chunks, mtime_ns) in enumerate(files):
            tmp = f"{TMP_PREFIX}{os.getpid()}.{secrets.token_hex(6)}.{name}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC,
                         0o600, dir_fd=dir_fd)
            pending.append((dir_fd, tmp, name, 0))
            size = 0
            try:
                for c in chunks:
                    mv = memoryview(c).cast("B")
                    while mv:
                        n = os.write(fd, mv)
                        size += n
                        mv = mv[n:]
                (fsync_file if i == len(files) - 1 else os.fsync)(fd)
                if mtime_ns is not None:
                    try:
                        os.utime(fd, ns=(mtime_ns, mtime_ns))
                    except (OSError, NotImplementedError):  # recency only: not worth failing
                        pass
            finally:
                os.close(fd)
            pending[-1] = (dir_fd, tmp, name, size)
        for i in range(len(files)):
            dir_fd, tmp, name, size = pending[0]
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            pending.pop(0)
            done(i, size)
    except BaseException:
        for dir_fd, tmp, _, _ in pending:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
        raise
    dirs = list(dict.fromkeys(f[0] for f in files))
    for j, dir_fd in enumerate(dirs):
        try:
            (fsync_file if j == len(dirs) - 1 else os.fsync)(dir_fd)
        except OSError:  # some file systems refuse to fsync a directory; the renames hold
            pass


def unlink(dir_fd: int, name: str) -> bool:
    """Remove ``name`` (a symlink itself, never its target). True if it is gone."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False
