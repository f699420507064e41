"""Eviction policies: small strategy objects chosen by name.

A policy tracks the resident pages that may be evicted some day (sealed pages kept for reuse) and,
asked for a victim, proposes one. The caller decides which pages are evictable right now (nothing
holds them, and no cached page continues them: policies choose among leaf pages only), through
the ``can_evict`` predicate; a policy never returns a page the predicate refuses.

Keys are block ids. ``ident`` is the page's content identity (its chained hash): block ids are
reused for other content, so history that outlives residency (S3-FIFO's ghost queue) uses it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Protocol

CanEvict = Callable[[int], bool]


class EvictionPolicy(Protocol):
    name: str

    def insert(self, block: int, ident: Hashable | None = None) -> None:
        """A page became resident and cached."""

    def access(self, block: int) -> None:
        """A resident page was reused (a prefix hit or a new holder)."""

    def remove(self, block: int) -> None:
        """A page left the cache by other means than ``victim`` (dropped, or freed)."""

    def victim(self, can_evict: CanEvict) -> int | None:
        """Choose, forget and return a page to evict, or None when no tracked page may go."""

    def __len__(self) -> int: ...

    def __contains__(self, block: int) -> bool: ...


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, block: int, ident: Hashable | None = None) -> None:
        self._order[block] = None
        self._order.move_to_end(block)

    def access(self, block: int) -> None:
        if block in self._order:
            self._order.move_to_end(block)

    def remove(self, block: int) -> None:
        self._order.pop(block, None)

    def victim(self, can_evict: CanEvict) -> int | None:
        for block in self._order:
            if can_evict(block):
                del self._order[block]
                return block
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return block in self._order


class FIFOPolicy(LRUPolicy):
    """First in, first out: a reuse does not refresh a page."""

    name = "fifo"

    def access(self, block: int) -> None:
        pass


class S3FIFOPolicy:
    """S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main FIFO, a ghost FIFO.

    New pages enter the small queue, unless their identity is in the ghost queue (evicted
    recently), then they enter the main queue. Evicting from the small queue (while it holds at
    least ``small_ratio`` of the pages) moves a page that was reused to the main queue and evicts
    one that was not, remembering its identity in the ghost queue. Evicting from the main queue
    gives a reused page another round (its count decremented) and evicts one that was not.
    A page that may not be evicted now (held, or not a leaf) is passed over: in the small queue
    it moves to the main queue, in the main queue it goes round again.
    """

    name = "s3fifo"
    MAX_FREQ = 3

    def __init__(self, small_ratio: float = 0.1, move_threshold: int = 1,
                 capacity: int | None = None) -> None:
        """``capacity``: pages the cache holds, when known; otherwise the most pages ever
        resident at once stands for it (it sizes the ghost queue)."""
        self.small_ratio = small_ratio
        self.move_threshold = move_threshold
        self.capacity = capacity
        self._small: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[int, int] = {}
        self._ident: dict[int, Hashable] = {}
        self._peak = 0  # the most pages resident at once

    def insert(self, block: int, ident: Hashable | None = None) -> None:
        self.remove(block)
        key = block if ident is None else ident
        self._ident[block] = key
        self._freq[block] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[block] = None
        else:
            self._small[block] = None
        self._peak = max(self._peak, len(self._small) + len(self._main))

    def access(self, block: int) -> None:
        if block in self._freq:
            self._freq[block] = min(self._freq[block] + 1, self.MAX_FREQ)

    def remove(self, block: int) -> None:
        self._small.pop(block, None)
        self._main.pop(block, None)
        self._freq.pop(block, None)
        self._ident.pop(block, None)

    def victim(self, can_evict: CanEvict) -> int | None:
        # Each page is looked at a bounded number of times: a full pass over both queues, plus
        # the main-queue rounds that decrement counts (at most MAX_FREQ per page).
        # NOTE: when every main page is passed over in a row (a full round refused by
        # ``can_evict``: held or not a leaf), the victim must come from the small queue even
        # below its share, or a cached small page would never be found.
        budget = (len(self._small) + len(self._main)) * (self.MAX_FREQ + 3) + 1
        main_refused = 0  # consecutive main pages that may not go now
        while budget > 0 and (self._small or self._main):
            budget -= 1
            total = len(self._small) + len(self._main)
            if self._small and (
                len(self._small) >= max(1, self.small_ratio * total)
                or main_refused >= len(self._main)
            ):
                block = self._evict_small(can_evict)
            else:
                head = next(iter(self._main))
                block = self._evict_main(can_evict)
                main_refused = main_refused + 1 if not can_evict(head) else 0
            if block is not None:
                return block
        return None

    def _evict_small(self, can_evict: CanEvict) -> int | None:
        block = next(iter(self._small))
        del self._small[block]
        if self._freq[block] >= self.move_threshold or not can_evict(block):
            self._freq[block] = 0
            self._main[block] = None
            return None
        self._ghost[self._ident[block]] = None
        # NOTE: as in the paper, the ghost queue remembers as many pages as the main queue can
        # hold (its share of the capacity), not as many as it holds now: the capacity is taken
        # as the most pages ever resident at once.
        capacity = self.capacity if self.capacity is not None else self._peak
        while len(self._ghost) > max(1, int(capacity * (1 - self.small_ratio))):
            self._ghost.popitem(last=False)
        self._freq.pop(block)
        self._ident.pop(block)
        return block

    def _evict_main(self, can_evict: CanEvict) -> int | None:
        block = next(iter(self._main))
        if not can_evict(block):
            self._main.move_to_end(block)
            return None
        if self._freq[block] > 0:
            self._freq[block] -= 1
            self._main.move_to_end(block)
            return None
        del self._main[block]
        self._freq.pop(block)
        self._ident.pop(block)
        return block

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, block: int) -> bool:
        return block in self._small or block in self._main


POLICIES: dict[str, type] = {p.name: p for p in (LRUPolicy, FIFOPolicy, S3FIFOPolicy)}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called ``name``: one of ``lru``, ``fifo``, ``s3fifo``."""
    try:
        return POLICIES[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
