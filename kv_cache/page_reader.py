"""Reading page files for a restore. The store's index already holds what each file's header
said (checked when the store wrote or indexed the file): its size, group, token count, a digest
of the header's bytes and the data's checksum. So a page costs one open, one read (header and
data, the data straight into its MLX array) and xxh3 passes, on a few threads when pages are
large (file reads and xxh3 release the GIL). A file changed since then (truncated, replaced,
damaged) no longer has the indexed size or digests: a miss. The reader
threads run no MLX and change no index: they report what they found, and the store (under its
lock) acts on it."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import mlx.core as mx

from . import atomic_fs as afs
from . import disk_format as fmt
from .disk_format import FormatError, Geometry

READ_THREADS = 4  # NOTE: pages are read and verified in parallel; more adds little on one SSD
# Below this many bytes a page, a restore is bound by the interpreter (the GIL), not by copies
# and hashing: one thread reads them all (measured: 500 pages of 16 KiB, 11 ms on one thread
# against 14 ms on two; 75 pages of 1.4 MiB, 24 ms against 12 ms).
PARALLEL_PAGE_BYTES = 256 << 10


class PageReader:
    """Reads page files under a store's ``pages`` directory (``pages_fd``)."""

    def __init__(self, geo: Geometry, pages_fd: int):
        self.geo, self.pages_fd = geo, pages_fd
        self._threads: ThreadPoolExecutor | None = None

    def read(self, pages: Sequence[tuple[bytes, int, object]]) -> list[tuple[str, object]]:
        """Per ``(hash, indexed file size, indexed FileInfo)``: ("ok", page array),
        ("nodir", None) when its directory is gone, or ("bad", error) when the file is missing,
        unreadable or no longer the file the index describes."""
        dests = fmt.page_dests(self.geo, [info.group for _, _, info in pages])
        found = self._fill_all(pages, [d for _, d in dests], [d.nbytes for _, d in dests])
        return [(kind, fmt.as_page(dest, self.geo, info.group) if kind == "ok" else got)
                for (kind, got), (_, _, info), (dest, _) in zip(found, pages, dests)]

    def read_run(self, pages: Sequence[tuple[bytes, int, object]],
                 group: int) -> tuple[mx.array, list[tuple[str, object]]]:
        """Consecutive pages of ``group`` into one array ``[layers, 2, kv_heads, len(pages) *
        page_size, head_dim]`` (``kv_cache.page_runs``), and per page what ``read`` says (its
        data is its slice of the array)."""
        arr, parts = fmt.run_dest(self.geo, group, len(pages))
        return fmt.as_page(arr, self.geo, group), self._fill_all(pages, parts,
                                                                 [p.nbytes for p in parts])

    def _fill_all(self, pages, dests: list, sizes: list[int]) -> list[tuple[str, object]]:
        names = [h.hex() for h, _, _ in pages]
        subs: dict[str, int | None] = {}  # each page folder opened once for the batch
        for name in names:
            if name[:2] not in subs:
                try:
                    subs[name[:2]] = afs.open_dir(name[:2], self.pages_fd, create=False)
                except OSError:
                    subs[name[:2]] = None
        parallel = sum(sizes) >= PARALLEL_PAGE_BYTES * len(sizes)
        try:
            return self._map(lambda x: self._fill(subs[x[0][:2]], x[0], *x[1], x[2]),
                             list(zip(names, pages, dests)), parallel)
        finally:
            for fd in subs.values():
                if fd is not None:
                    os.close(fd)

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown()
            self._threads = None

    def _map(self, fn, items: Sequence, parallel: bool = True) -> list:
        """``[fn(x) for x in items]``, in READ_THREADS runs of consecutive items (one task a
        run: a page costs less than handing it to a thread), or here when not ``parallel``."""
        if len(items) < 2 or not parallel:
            return [fn(x) for x in items]
        if self._threads is None:
            self._threads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-read")
        k = -(-len(items) // READ_THREADS)
        runs = [items[i : i + k] for i in range(0, len(items), k)]
        return [y for run in self._threads.map(lambda r: [fn(x) for x in r], runs) for y in run]

    def _fill(self, sub_fd: int | None, name: str, h: bytes, size: int, info, dest):
        """("ok", None) once the page's data is in ``dest`` and the file is the one the index
        describes, ("nodir", None) when its folder could not be opened, else ("bad", error)."""
        if sub_fd is None:
            return "nodir", None
        try:
            fd, got = afs.open_regular(name + ".safetensors", sub_fd)
        except (FormatError, OSError) as e:
            return "bad", e
        try:
            if got == size and fmt.fill_page(fd, size, dest, info.head_sum, info.checksum):
                return "ok", None
            return "bad", self._why(fd, got, h, info)
        except (FormatError, OSError) as e:
            return "bad", e
        finally:
            os.close(fd)

    def _why(self, fd: int, size: int, h: bytes, info) -> Exception:
        """What is wrong with a page file that changed since it was indexed (a whole check of
        its header: foreign or malformed), for the log and the counters."""
        try:
            fmt.parse_page(self.geo, fmt.read_header(fd, size), h,
                           fmt.TAIL_FORMAT if info.partial else fmt.PAGE_FORMAT)
        except (FormatError, OSError) as e:
            return e
        return FormatError("changed since it was written or indexed (checksum mismatch)")
