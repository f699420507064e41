"""Who holds a page: the pool's ref counts, split by the kind of holder.

Invariant 2 (docs/ARCHITECTURE.md): a page's ref count is the number of its holders. The pool
keeps the count per kind of holder as well, as holds are taken and dropped, so that a check or a
report asks one place who holds a page (is anything but the cache's own records holding pages
once every request is done?) instead of walking the manager's entries, its resident sequences
and the live prefix views.
"""

from __future__ import annotations

from typing import Iterable

SEQUENCE = "sequence"  # a sequence being built or run (and a restore building one)
RESIDENT = "resident"  # a finished sequence the manager keeps with its working buffers
ENTRY = "entry"  # a stored entry (a turn, a state point)
VIEW = "view"  # a shared prefix view (kv_cache.model.attention)
KINDS = (SEQUENCE, RESIDENT, ENTRY, VIEW)


class Holders:
    """Per kind of holder, the pages it holds and how many times. Summed over the kinds, a
    page's count is its ref count (``PagePool`` keeps both in step)."""

    __slots__ = ("_by",)

    def __init__(self) -> None:
        self._by: dict[str, dict[int, int]] = {k: {} for k in KINDS}

    def counts(self, kind: str) -> dict[int, int]:
        """The live block -> holds map of ``kind`` (the pool updates it in place)."""
        counts = self._by.get(kind)
        if counts is None:
            raise ValueError(f"unknown kind of holder {kind!r}; one of {KINDS}")
        return counts

    def held_by(self, kind: str) -> dict[int, int]:
        """The pages that holders of ``kind`` hold, and how many times each (a copy)."""
        return dict(self.counts(kind))

    def of(self, block: int) -> dict[str, int]:
        """The holds on ``block`` by each kind that holds it."""
        return {k: c[block] for k, c in self._by.items() if block in c}

    def move(self, blocks: Iterable[int | None], src: str, dst: str) -> None:
        """The holds of ``src`` on ``blocks`` (one each; None skipped) pass to ``dst``: the
        holder changed role (a finished sequence kept resident, or taken back to run)."""
        a, b = self.counts(src), self.counts(dst)
        for block in blocks:
            if block is None:
                continue
            n = a.get(block, 0)
            assert n > 0, f"block {block}: no {src} hold to pass to {dst}"
            if n == 1:
                del a[block]
            else:
                a[block] = n - 1
            b[block] = b.get(block, 0) + 1
