"""Kinds of cache layer: what a query reads, and so which pages a group needs and releases.

Every rule that depends on the kind of a layer group lives here, once: the callers (the
sequence, the manager, restoring, the disk lookup, export) ask the group's kind object instead
of comparing kind names. A kind is a small frozen value; its ``name`` (and a window's size) is
what the cache spec's canonical JSON records (``kv_cache.layout.spec``).

- ``FullAttention``: a query reads every earlier position, so every page from the first is
  needed, kept, and can be shared through a prefix view (``kv_cache.model.attention``).
- ``SlidingWindow(window)``: a query at position ``p`` reads ``p - window + 1 .. p``; pages wholly
  before that are released, and a hit is usable only where the pages its window reads are held.
- ``RecurrentState``: a few arrays summarising everything so far; not paged, and usable only
  where a snapshot of it was taken (where an entry ends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence


class PagedKind:
    """What a paged group's queries read after ``n`` cached positions (pages of ``P``)."""

    __slots__ = ()
    name: ClassVar[str]
    # Whether a query reads every earlier position: every page from the first is kept (none is
    # released), a hit is found page by page from the first, and a prefix view can serve it.
    reads_all: ClassVar[bool]
    window: int = 0

    def first_needed(self, n: int) -> int:
        """The first position a query after ``n`` cached positions reads."""
        raise NotImplementedError

    def first_page(self, n: int, P: int) -> int:
        """The index of the page holding ``first_needed(n)``."""
        return self.first_needed(n) // P

    def keep_from(self, n: int, P: int) -> int:
        """The first position that must be kept after ``n`` positions (page-aligned): pages
        before it are never read again and are released."""
        return self.first_needed(n) // P * P

    def pages(self, n: int, P: int) -> slice:
        """The page range a query after ``n`` positions reads (of a table of ``P``-pages)."""
        return slice(self.first_needed(n) // P, -(-n // P))

    def holds(self, table: Sequence[object | None], n: int, P: int) -> bool:
        """Whether ``table`` (None: a released page) holds every page that range reads."""
        need = self.pages(n, P)
        got = table[need]
        return len(got) == need.stop - need.start and None not in got

    def cut(self, table: Sequence[object | None], n: int, P: int) -> list:
        """``table`` cut to the pages the first ``n`` positions use, None for the pages a query
        after them no longer reads."""
        t = list(table[: -(-n // P)])
        skip = min(self.first_page(n, P), len(t))
        return [None] * skip + t[skip:]


@dataclass(frozen=True, slots=True)
class FullAttention(PagedKind):
    """mlx-lm's ``KVCache``: keys and values of every position."""

    name: ClassVar[str] = "full"
    reads_all: ClassVar[bool] = True

    def first_needed(self, n: int) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class SlidingWindow(PagedKind):
    """mlx-lm's ``RotatingKVCache(max_size=window, keep=0)``."""

    window: int
    name: ClassVar[str] = "sliding"
    reads_all: ClassVar[bool] = False

    def first_needed(self, n: int) -> int:
        return max(0, n - self.window + 1)


@dataclass(frozen=True, slots=True)
class RecurrentState:
    """mlx-lm's ``ArraysCache`` (conv, SSM, gated-delta states): it cannot be rewound."""

    name: ClassVar[str] = "state"

    def usable(self, n: int, length: int, has_snapshot: bool) -> bool:
        """Whether a stored entry of ``length`` tokens (with or without a snapshot of the state
        after them) can serve its first ``n``: only in full, where the snapshot was taken."""
        return n == length and has_snapshot


FULL = FullAttention()
STATE = RecurrentState()


def paged_kind(name: str, window: int) -> PagedKind:
    """The kind a cache spec's JSON names (``name``, ``window``)."""
    if name == FullAttention.name:
        return FULL
    if name == SlidingWindow.name:
        return SlidingWindow(window)
    raise ValueError(f"unknown kind of cache layer {name!r}")
