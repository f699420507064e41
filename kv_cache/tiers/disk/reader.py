"""Reading page files for a restore. The store's index already holds what each file's header
said (checked when the store wrote or indexed the file): its size, group, token count, a digest
of the header's bytes and the data's checksum. So a page costs one open, one read (header and
data together) and two xxh3 passes, in a tight loop (a restore of a small model reads many small
pages: per page, the interpreter's work is the cost), on a few threads when pages are large
(file reads and copies release the GIL). A file changed since then (truncated, grown, replaced,
damaged) no longer has the indexed size or digests: it is read again on the careful path
(``_fill``), which says what is wrong, and is a miss. The reader threads run no MLX and change
no index: they report what they found, and the store (under its lock) acts on it."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import mlx.core as mx

from kv_cache.tiers.disk import atomic_fs as afs
from kv_cache.tiers.disk import file_data
from kv_cache.tiers.disk import file_format as fmt
from kv_cache.tiers.disk import framing
from kv_cache.tiers.disk.file_format import FormatError, Geometry

READ_THREADS = 4  # NOTE: pages are read and verified in parallel; more adds little on one SSD
# Below this many bytes a page, a restore is bound by the interpreter (the GIL), not by copies
# and hashing: one thread reads them all (measured: 500 pages of 16 KiB, 11 ms on one thread
# against 14 ms on two; 75 pages of 1.4 MiB, 24 ms against 12 ms).
PARALLEL_PAGE_BYTES = 256 << 10
# A page file opened without following a symlink, never blocking (a FIFO planted in its place
# reads nothing); no fstat: a read of one byte more than the indexed size says whether the file
# still has that size, and anything but a regular file of it fails the checks.
_OPEN = os.O_RDONLY | afs.NOFOLLOW | afs.NONBLOCK | afs.CLOEXEC


class PageReader:
    """Reads page files under a store's ``pages`` directory (``pages_fd``)."""

    def __init__(self, geo: Geometry, pages_fd: int):
        self.geo, self.pages_fd = geo, pages_fd
        self._threads: ThreadPoolExecutor | None = None

    def read(self, pages: Sequence[tuple[bytes, int, object]]) -> list[tuple[str, object]]:
        """Per ``(hash, indexed file size, indexed FileInfo)``: ("ok", page array),
        ("nodir", None) when its directory is gone, or ("bad", error) when the file is missing,
        unreadable or no longer the file the index describes."""
        dests = file_data.page_dests(self.geo, [info.group for _, _, info in pages])
        found = self._fill_all(pages, [d for _, d in dests], [d.nbytes for _, d in dests])
        return [(kind, file_data.as_page(dest, self.geo, info.group) if kind == "ok" else got)
                for (kind, got), (_, _, info), (dest, _) in zip(found, pages, dests)]

    def read_run(self, pages: Sequence[tuple[bytes, int, object]],
                 group: int) -> tuple[mx.array, list[tuple[str, object]]]:
        """Consecutive pages of ``group`` into one array ``[layers, 2, kv_heads, len(pages) *
        page_size, head_dim]`` (``kv_cache.pages.runs``), and per page what ``read`` says (its
        data is its slice of the array)."""
        arr, parts = file_data.run_dest(self.geo, group, len(pages))
        return file_data.as_page(arr, self.geo, group), self._fill_all(pages, parts,
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
        items = [(subs[name[:2]], name + ".safetensors", page, dest)
                 for name, page, dest in zip(names, pages, dests)]
        parallel = sum(sizes) >= PARALLEL_PAGE_BYTES * len(sizes)
        try:
            return self._map(self._fill_many, items, parallel)
        finally:
            for fd in subs.values():
                if fd is not None:
                    os.close(fd)

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown()
            self._threads = None

    def _map(self, fn, items: Sequence, parallel: bool = True) -> list:
        """``fn(items)``, in READ_THREADS runs of consecutive items (one task a run: a page
        costs less than handing it to a thread), or here in one when not ``parallel``."""
        if len(items) < 2 or not parallel:
            return fn(items)
        if self._threads is None:
            self._threads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-read")
        k = -(-len(items) // READ_THREADS)
        runs = [items[i : i + k] for i in range(0, len(items), k)]
        return [y for run in self._threads.map(fn, runs) for y in run]

    def _fill_many(self, items: Sequence) -> list[tuple[str, object]]:
        """What ``read`` says per item ``(folder fd, file name, (hash, size, info), dest)``. The fast
        path: the file read whole into this thread's buffer (one byte more than the indexed
        size: a grown file shows), its two digests compared, its data copied into ``dest``;
        anything else goes to ``_fill``."""
        stage = file_data.staging(max((size for _, _, (_, size, _), _ in items), default=0) + 1)
        out: list[tuple[str, object]] = []
        for sub, name, (h, size, info), dest in items:
            if sub is None:
                out.append(("nodir", None))
                continue
            start = size - dest.nbytes  # the header's bytes; the data follows
            whole = not isinstance(dest, memoryview)  # a run's strided rows: read, then copied
            got = -1
            if start > 0:
                try:
                    fd = os.open(name, _OPEN, dir_fd=sub)
                    try:
                        got = os.readv(fd, [stage[: size + 1]] if whole
                                       else [stage[:start], dest, stage[start : start + 1]])
                    finally:
                        os.close(fd)
                except OSError:
                    pass
            data = stage[start:size] if whole else dest
            if got == size and framing.head_digest(stage[:start]) == info.head_sum \
                    and fmt.checksum(data) == info.checksum:
                if whole:
                    dest[...] = data.reshape(dest.shape)
                out.append(("ok", None))
            else:
                out.append(self._fill(sub, name, h, size, info, dest))
        return out

    def _fill(self, sub_fd: int, name: str, h: bytes, size: int, info, dest):
        """The careful path: ("ok", None) once the page's data is in ``dest`` and the file is
        the one the index describes, else ("bad", error) saying what is wrong with it."""
        try:
            fd, got = afs.open_regular(name, sub_fd)
        except (FormatError, OSError) as e:
            return "bad", e
        try:
            if got == size and file_data.fill_page(fd, size, dest, info.head_sum, info.checksum):
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
            fmt.parse_page(self.geo, framing.read_header(fd, size), h,
                           fmt.TAIL_FORMAT if info.partial else fmt.PAGE_FORMAT)
        except (FormatError, OSError) as e:
            return e
        return FormatError("changed since it was written or indexed (checksum mismatch)")
