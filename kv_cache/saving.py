"""Saving entries to disk off the generating thread.

An entry saved in memory is handed to ``Saving.add``, which takes what its disk copy needs as
references (no copy, no lock); ``flush`` (once the answer is out) turns each into plain host
bytes and a ``Tier.put`` that the ``DiskWriter`` thread runs in order, so saving never delays an
answer. Without a store there is nothing to write and each call does nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import mlx.core as mx

from kv_cache.entries import Entry
from kv_cache.pages.pool import PagePool
from kv_cache.stats import ManagerStats
from kv_cache.tiers.base import PageRecord, Tier, host_array

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


class Saving:
    """Disk copies of ``pool``'s entries in ``store`` (none without one), counted in
    ``stats``."""

    def __init__(self, pool: PagePool, store: Tier | None, stats: ManagerStats):
        self.pool, self.store, self.stats = pool, store, stats
        self._pending: list[tuple] = []  # entries to write, handed to the writer by flush()
        self._writer = DiskWriter() if store is not None else None

    def add(self, entry: Entry, again: bool = True) -> None:
        """Write ``entry`` to disk with the next ``flush``; not ``again`` where the store holds
        its key already (a state point is the same entry whoever reaches it)."""
        if self.store is not None and (again or self.store.get(entry.key) is None):
            self._pending.append(self._capture(entry))

    def flush(self) -> None:
        """Hand pending entries to the disk writer (call once the answer is out)."""
        pending, self._pending = self._pending, []
        for captured in pending:
            self._writer.submit(self._writer_task(captured))

    def submit(self, task: Callable[[], None]) -> None:
        """Run ``task`` (a write of the store's keyed arrays, ``kv_cache.arrays``, given host
        bytes) on the disk writer, in order with the entries' writes; nothing without a store."""
        if self._writer is not None:
            self._writer.submit(task)

    def sync(self) -> None:
        """Wait for every write handed to the disk writer (for a consistent view of the disk)."""
        self.flush()
        if self._writer is not None:
            self._writer.drain()

    def close(self) -> None:
        """Finish the disk writes and close the store."""
        self.sync()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self.store.close()

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
        return entry.key, entry.tokens, pages, tails, layout, entry.state, entry.spans

    def _writer_task(self, captured: tuple) -> Callable[[], None]:
        key, tokens, pages, tails, layout, state, spans = captured
        # Pages already on disk need no data; the rest go over as host bytes (zero-copy).
        records = [PageRecord(h, t, None if self.store.has_page(h) else host_array(d), g)
                   for g, h, t, d in pages]
        tails = {g: host_array(d) for g, d in tails.items()}
        state = None if state is None else [[host_array(a) for a in arrays] for arrays in state]

        def write() -> None:
            try:
                ok = self.store.put(key, tokens, records, pinned=(key,), tails=tails,
                                    layout=layout, state=state, spans=spans)
            except ValueError as e:  # e.g. a page evicted from disk since the check above
                log.info("cache entry %s not saved to disk: %s", key, e)
                ok = False
            if ok:
                self.stats.disk_saves += 1
            else:
                self.stats.disk_save_failures += 1
        return write
