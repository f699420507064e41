"""Making room in the page pool by dropping what the manager keeps for reuse.

The pool never calls up: when its cached pages are not enough, ``allocate`` raises
``OutOfBlocksError`` saying what it needed, and whoever was allocating makes room and tries again
(``with_room``). Room is made from the holders kept for reuse alone, least recently used first:
resident sequences (kept for a next turn), then entries, whose sealed pages stay cached (and
findable by tokens) until the pool's eviction takes them. Running sequences are the caller's to
give up (the server preempts one only once nothing is left here to drop).
"""

from __future__ import annotations

from typing import Callable, TypeVar

from kv_cache.entries import Entries
from kv_cache.errors import OutOfBlocksError
from kv_cache.pages.pool import PagePool
from kv_cache.residents import Residents
from kv_cache.saving import Saving
from kv_cache.stats import ManagerStats
from kv_cache.tiers.base import Tier

T = TypeVar("T")


class Room:
    """Room in ``pool`` made by dropping ``residents``, then ``entries`` (counted in
    ``stats.entries_dropped``); ``shed`` also drops the entries that ``store`` holds (once
    ``saving`` has written them all)."""

    def __init__(self, pool: PagePool, residents: Residents, entries: Entries,
                 stats: ManagerStats, store: Tier | None, saving: Saving):
        self.pool, self.residents, self.entries = pool, residents, entries
        self.stats, self.store, self.saving = stats, store, saving

    def make_room(self, n_pages: int, group: int = 0) -> bool:
        """Drop holders, least recently used first, until the pool can allocate ``n_pages``
        pages of ``group``: resident sequences, then entries. Whether anything was dropped
        (so that trying again may succeed)."""
        dropped = False
        while self.residents and not self.pool.can_allocate(n_pages, group):
            self.residents.close_oldest()
            dropped = True
        while self.entries and not self.pool.can_allocate(n_pages, group):
            self.entries.drop_oldest()
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
        self.residents.close_all()
        if self.store is not None:
            self.saving.sync()  # every entry's write done: the disk holds what it was given
            for key in [k for k in self.entries if self.store.get(k) is not None]:
                self.entries.drop(key)
        return self.pool.evict_all_cached()
