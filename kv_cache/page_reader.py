"""Reading page files for a restore: every header is read and checked first, then each page's
bytes go straight into its MLX array and are verified, on a few threads (file reads and xxh3
release the GIL). The reader threads run no MLX and change no index: they report what they
found, and the store (under its lock) acts on it."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from . import atomic_fs as afs
from . import disk_format as fmt
from .disk_format import FormatError, Geometry

READ_THREADS = 4  # NOTE: pages are read and verified in parallel; more adds little on one SSD


class PageReader:
    """Reads page files under a store's ``pages`` directory (``pages_fd``)."""

    def __init__(self, geo: Geometry, pages_fd: int):
        self.geo, self.pages_fd = geo, pages_fd
        self._threads: ThreadPoolExecutor | None = None

    def read(self, hashes: Sequence[bytes]) -> list[tuple[str, object]]:
        """Per hash: ("ok", page array), ("nodir", None) when its directory is gone, or
        ("bad", error) when the file is missing, unreadable or not a valid page of ours."""
        subs: dict[str, int | None] = {}  # each page folder opened once for the batch
        for h in hashes:
            sub = h.hex()[:2]
            if sub not in subs:
                try:
                    subs[sub] = afs.open_dir(sub, self.pages_fd, create=False)
                except OSError:
                    subs[sub] = None
        try:
            opened = self._map(lambda h: self._open(h, subs[h.hex()[:2]]), hashes)
        finally:
            for fd in subs.values():
                if fd is not None:
                    os.close(fd)
        made = iter(fmt.page_dests(self.geo, [got[2].group for kind, got in opened
                                               if kind == "ok"]))
        dests = [next(made) if kind == "ok" else None for kind, _ in opened]
        filled = iter(self._map(lambda x: self._fill(*x),
                                [(got, d[1]) for (kind, got), d in zip(opened, dests)
                                 if kind == "ok"]))
        out = []
        for (kind, got), dest in zip(opened, dests):
            if kind == "ok":
                kind, got = next(filled)
                if kind == "ok":
                    got = fmt.as_page(dest[0], self.geo, got.group)
            out.append((kind, got))
        return out

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown()
            self._threads = None

    def _map(self, fn, items: Sequence) -> list:
        if len(items) < 2:
            return [fn(x) for x in items]
        if self._threads is None:
            self._threads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-read")
        return list(self._threads.map(fn, items))

    def _open(self, h: bytes, sub_fd: int | None):
        """("ok", (fd, header, page info)), ("nodir", None) or ("bad", error); ``sub_fd``: the
        page's folder (None: it could not be opened)."""
        if sub_fd is None:
            return "nodir", None
        name = h.hex() + ".safetensors"
        fd = None
        try:
            fd, size = afs.open_regular(name, sub_fd)
            hdr = fmt.read_header(fd, size)
            return "ok", (fd, hdr, fmt.parse_page(self.geo, hdr, h))
        except (FormatError, OSError) as e:
            if fd is not None:
                os.close(fd)
            return "bad", e

    @staticmethod
    def _fill(opened, dest: memoryview):
        """("ok", page info) once the page's bytes are in ``dest`` and verified, else ("bad",
        error); closes the file."""
        fd, hdr, info = opened
        try:
            fmt.fill_page(fd, hdr, dest)
            return "ok", info
        except (FormatError, OSError) as e:
            return "bad", e
        finally:
            os.close(fd)
