"""Saving entries to disk off the generating thread: a part of ``CacheManager``.

``_capture`` takes what an entry's disk copy needs as references when it is saved (no copy, no
lock); ``_writer_task`` turns that into plain host bytes and a ``DiskStore.put`` that the
``DiskWriter`` thread runs in order, so saving never delays an answer.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Callable

import mlx.core as mx

from kv_cache.tiers.base import PageRecord, host_array

if TYPE_CHECKING:
    from kv_cache.entries import Entry

log = logging.getLogger("kv_cache.manager")


class DiskWriter:
    """One background thread that runs disk writes in order, so saving an entry never delays
    an answer or the next request. It is handed plain host bytes: it never runs MLX."""

    def __init__(self) -> None:
        self._tasks: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def drain(self) -> None:
        """Wait until every submitted write is done."""
        self._tasks.join()

    def close(self) -> None:
        self._tasks.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except Exception:  # a disk problem never takes the server down
                log.exception("saving a cache entry to disk failed")
            finally:
                # NOTE: the task holds its entry's pages (host views of MLX arrays): kept in this
                # frame until the next write, an evicted entry's pages stayed in memory
                del task
                self._tasks.task_done()
        self._tasks.task_done()


class DiskSaving:
    """The manager's disk copies (``self.pool``, ``self.store``, ``self.stats``)."""

    def _capture(self, entry: Entry) -> tuple:
        """What the disk copy of ``entry`` needs, as references (no copy, no lock): the pages
        may be evicted from memory before the write, their arrays stay alive."""
        P, pool, n = self.pool.page_size, self.pool, len(entry.tokens)
        full = n // P
        pages, tails, layout = [], {}, []
        for g, table in enumerate(entry.tables):
            present = [(i, b) for i, b in enumerate(table[:full]) if b is not None]
            skip = present[0][0] if present else full
            layout.append((skip, full - skip))
            pages += [(g, pool.hash_of(b), pool.tokens(b), pool.data(b)) for _, b in present]
            if n % P:
                tails[g] = mx.contiguous(pool.data(table[full])[:, :, :, : n % P, :])
        return entry.key, entry.tokens, pages, tails, layout, entry.state

    def _writer_task(self, captured: tuple) -> Callable[[], None]:
        key, tokens, pages, tails, layout, state = captured
        # Pages already on disk need no data; the rest go over as host bytes (zero-copy).
        records = [PageRecord(h, t, None if self.store.has_page(h) else host_array(d), g)
                   for g, h, t, d in pages]
        tails = {g: host_array(d) for g, d in tails.items()}
        state = None if state is None else [[host_array(a) for a in arrays] for arrays in state]

        def write() -> None:
            try:
                ok = self.store.put(key, tokens, records, pinned=(key,), tails=tails,
                                    layout=layout, state=state)
            except ValueError as e:  # e.g. a page evicted from disk since the check above
                log.info("cache entry %s not saved to disk: %s", key, e)
                ok = False
            if ok:
                self.stats.disk_saves += 1
            else:
                self.stats.disk_save_failures += 1
        return write
