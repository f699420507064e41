"""The disk store's root: its folders opened once, never through a symlink (every later open is
relative to these fds, so a link planted in the tree is never followed), a lock that keeps a
second store out (two stores on one root would each evict the other's files), and the store's
own small notes at the root.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kv_cache.tiers.disk import atomic_fs as afs

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("kv_cache.tiers.disk.store")
FOLDERS = ("entries", "pages", "tails", "arrays")


class DiskStoreLockedError(RuntimeError):
    """Another DiskStore (this process or another) has the root open."""


class StoreDirs:
    """The fds of a store's root and of its ``entries``, ``pages``, ``tails`` and ``arrays``
    folders (made if missing), the root locked while they are open."""

    def __init__(self, root: Path):
        self.root = root
        self._fds: list[int] = []
        self.root_fd = afs.open_dir(str(root), None, create=False)
        self._fds.append(self.root_fd)
        try:
            self._take_lock()
            self.entries_fd, self.pages_fd, self.tails_fd, self.arrays_fd = \
                (self._open(f) for f in FOLDERS)
        except BaseException:
            self.close()
            raise

    def _open(self, name: str) -> int:
        fd = afs.open_dir(name, self.root_fd, create=True)
        self._fds.append(fd)
        return fd

    def write_note(self, name: str, data: bytes) -> bool:
        """Write a small file of the store's own at the root, after removing temp files a crash
        left there. A temp file and a rename: a link planted under ``name`` is replaced, never
        written through. False (logged) on failure."""
        if not name or "/" in name or name.startswith(".") or name in FOLDERS:
            raise ValueError(f"not a note name: {name!r}")
        try:
            for f in os.listdir(self.root_fd):  # a write that a crash cut short
                if f.startswith(afs.TMP_PREFIX):
                    afs.unlink(self.root_fd, f)
            afs.atomic_write(self.root_fd, name, [data])
            return True
        except OSError as e:
            log.warning("disk store: could not write %s: %s", name, e)
            return False

    def _take_lock(self) -> None:
        if fcntl is None:
            return
        flags = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(".lock", os.O_RDWR | os.O_CREAT | flags, 0o600, dir_fd=self.root_fd)
        except OSError:
            try:
                fd = os.open(".lock", os.O_RDONLY | flags, dir_fd=self.root_fd)
            except OSError as e:
                log.warning("disk store: no lock file (%s); make sure one store uses %s", e,
                            self.root)
                return
        self._fds.append(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DiskStoreLockedError(f"another disk store has {self.root} open") from None
        except OSError as e:
            log.warning("disk store: cannot lock %s (%s)", self.root, e)

    def close(self) -> None:
        """Close every fd (the lock goes with its fd)."""
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
