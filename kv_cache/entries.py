"""The entries in memory: what finished turns left behind, each holding its pages.

An ``Entry`` is a saved sequence under a key: the token ids of prompt + answer, the pages of each
group that hold their keys and values, the recurrent state after them where the model has one, and
the image spans among them. ``Entries`` keeps them least recently used first; each entry is one
holder (``ENTRY``) of its pages in the pool, so a page an entry uses stays in memory while the entry
does. Dropping an entry gives its holds back: its sealed pages stay cached (and findable by tokens)
until the pool's own eviction takes them. What goes to disk, and when, is ``saving.py``'s.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

from kv_cache.model.sequence import PagedSequence, Snapshot
from kv_cache.model.state_points import is_point
from kv_cache.pages.holders import ENTRY
from kv_cache.pages.pool import PagePool
from kv_cache.pages.spans import Span, before


@dataclass(slots=True)
class Entry:
    key: str
    tokens: tuple[int, ...]
    tables: list[list[int | None]]  # per cache group; None: a page no window at the end reads
    state: Snapshot | None = None  # recurrent state after ``tokens``
    spans: tuple[Span, ...] = ()  # the image spans that begin in ``tokens`` (pages.spans)

    @property
    def blocks(self) -> list[int | None]:
        """Group 0's pages."""
        return self.tables[0] if self.tables else []


class Entries:
    """The entries of one pool, by key, least recently used first."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self._entries: OrderedDict[str, Entry] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        """The keys, least recently used first."""
        return iter(self._entries)

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def touch(self, key: str) -> None:
        """``key`` is the most recently used now."""
        self._entries.move_to_end(key)

    def keep(self, key: str, seq: PagedSequence, n: int, state: Snapshot | None) -> Entry:
        """``seq``'s first ``n`` tokens (committed) as the entry ``key``, holding their pages;
        an entry of that key before it is dropped (after the new one holds its pages, so a page
        both use stays)."""
        tables = seq.prefix_tables(n)
        for t in tables:
            self.pool.hold_all(t, ENTRY)
        self.drop(key)
        self._entries[key] = entry = Entry(key, tuple(seq.tokens[:n]), tables, state,
                                           before(seq.spans, n))
        return entry

    def drop(self, key: str) -> bool:
        """Forget ``key``, giving its pages' holds back; whether it was here."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        for t in entry.tables:
            self.pool.release_all(t, ENTRY)
        return True

    def drop_oldest(self) -> None:
        """Drop the least recently used entry (there must be one)."""
        self.drop(next(iter(self._entries)))

    def trim_points(self, keep: int) -> None:
        """Drop the least recently used state points (``kv_cache.model.state_points``) beyond
        ``keep``."""
        held = [k for k in self._entries if is_point(k)]
        for key in held[: max(0, len(held) - keep)]:
            self.drop(key)
