"""The pool's byte budget: what its pages take of it, and which of them could be given back.

Every page with storage counts its group's page size against ``max_bytes``; a cached page (sealed,
held by nothing, kept for reuse) still counts but can be evicted for room. The pool tells the
budget each page's changes (``use``, ``give_back``, ``cache``, ``uncache``, ``evicted``) and asks
it whether pages fit (``fits``) or whether it must evict first (``over``); the figures are what
the pool's ``stats`` report.
"""

from __future__ import annotations

from typing import Sequence


class Budget:
    """Bytes of ``max_bytes`` taken by pages of ``page_bytes[group]`` bytes each."""

    __slots__ = ("max_bytes", "page_bytes", "used_bytes", "cached_pages", "cached_bytes",
                 "evictions")

    def __init__(self, max_bytes: int, page_bytes: Sequence[int]):
        self.max_bytes = max_bytes
        self.page_bytes = list(page_bytes)
        self.used_bytes = 0  # every page with storage
        self.cached_pages = 0  # indexed pages held by nothing
        self.cached_bytes = 0
        self.evictions = 0  # pages evicted since the pool was made

    def fits(self, n: int, group: int, free_ids: int) -> bool:
        """Whether ``n`` pages of ``group`` fit, evicting cached pages if need be (``free_ids``:
        the allocator's free block ids)."""
        free_bytes = self.max_bytes - self.used_bytes + self.cached_bytes
        return n * self.page_bytes[group] <= free_bytes and n <= free_ids + self.cached_pages

    def over(self, n: int, group: int) -> bool:
        """Whether ``n`` more pages of ``group`` exceed the budget as it stands (before any
        eviction)."""
        return self.used_bytes + n * self.page_bytes[group] > self.max_bytes

    def use(self, n: int, group: int) -> None:
        """``n`` pages of ``group`` now have storage."""
        self.used_bytes += n * self.page_bytes[group]

    def give_back(self, group: int) -> None:
        """One page of ``group`` has storage no more."""
        self.used_bytes -= self.page_bytes[group]

    def cache(self, group: int, n: int = 1) -> None:
        """``n`` indexed pages of ``group`` are held by nothing now: evictable."""
        self.cached_pages += n
        self.cached_bytes += n * self.page_bytes[group]

    def uncache(self, group: int) -> None:
        """A cached page of ``group`` is held again, or goes."""
        self.cached_pages -= 1
        self.cached_bytes -= self.page_bytes[group]

    def evicted(self, group: int) -> None:
        """A cached page of ``group`` was evicted (its storage given back separately)."""
        self.uncache(group)
        self.evictions += 1
