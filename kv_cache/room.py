"""Making room in the page pool: a part of ``CacheManager`` (``manager.py``).

The pool never calls up: when its cached pages are not enough, ``allocate`` raises
``OutOfBlocksError`` saying what it needed, and whoever was allocating asks the manager to make
room and tries again (``with_room``). The manager drops its own holders, least recently used
first: resident sequences (kept for a next turn), then entries, whose sealed pages stay cached
(and findable by tokens) until the pool's eviction takes them. Running sequences are the
caller's to give up (the scheduler preempts one only once the manager has nothing left to drop).
"""

from __future__ import annotations

from typing import Callable, TypeVar

from kv_cache.errors import OutOfBlocksError
from kv_cache.model.sequence import PagedSequence
from kv_cache.pages.holders import RESIDENT, SEQUENCE

T = TypeVar("T")


class Room:
    """``self.pool``, ``self._resident``, ``self._entries``, ``self.drop``, ``self.store``,
    ``self.sync`` and ``self.stats`` are the manager's."""

    def make_room(self, n_pages: int, group: int = 0) -> bool:
        """Drop holders, least recently used first, until the pool can allocate ``n_pages``
        pages of ``group``: resident sequences, then entries. Whether anything was dropped
        (so that trying again may succeed)."""
        dropped = False
        while self._resident and not self.pool.can_allocate(n_pages, group):
            self._unreside(next(iter(self._resident))).close()
            dropped = True
        while self._entries and not self.pool.can_allocate(n_pages, group):
            self.drop(next(iter(self._entries)), from_disk=False)
            self.stats.entries_dropped += 1
            dropped = True
        return dropped

    def with_room(self, fn: Callable[[], T]) -> T:
        """``fn()``, which takes pages: each time the pool runs out, ``make_room`` for what it
        asked and try again; ``OutOfBlocksError`` once nothing is left to drop. ``fn`` must be
        safe to try again (``PagedSequence.commit`` is: it goes on where it stopped)."""
        while True:
            try:
                return fn()
            except OutOfBlocksError as e:
                if e.pages is None or not self.make_room(e.pages, e.group):
                    raise

    def shed(self) -> int:
        """Give back the memory nothing running needs, for the caller's memory budget: resident
        sequences' working buffers, then (with a disk tier) the entries the disk holds, whose
        pages come back from it when asked, then every cached page that nothing holds. Entries
        without a copy on disk stay. Returns the pages freed."""
        while self._resident:
            self._unreside(next(iter(self._resident))).close()
        if self.store is not None:
            self.sync()  # every entry's write done: the disk holds what it was given
            for key in [k for k in self._entries if self.store.get(k) is not None]:
                self.drop(key, from_disk=False)
        return self.pool.evict_all_cached()

    def _unreside(self, key: int) -> PagedSequence:
        """Resident sequence ``key``, no longer resident: its holds are a sequence's again."""
        seq = self._resident.pop(key)
        self.pool.holders.move((b for t in seq.tables for b in t.blocks), RESIDENT, SEQUENCE)
        return seq
