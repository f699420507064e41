"""Prefix views: the keys and values of a run of sealed pages, contiguous per layer, read by
every sequence whose context starts with them (``kv_cache.model.attention`` computes attention
over a view and each sequence's own positions).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import mlx.core as mx

from kv_cache.pages.holders import VIEW

if TYPE_CHECKING:
    from kv_cache.pages.pool import PagePool


class PrefixView:
    """The keys and values of ``length`` positions held by sealed pages (one table per
    full-attention group), contiguous per layer: ``[kv_heads, length, head_dim]`` (pages in
    bits decoded)."""

    def __init__(self, pool: "PagePool", tables: list[tuple[int, ...]], length: int,
                 groups: list[int]):
        self.pool, self.tables, self.length, self.groups = pool, tables, length, groups
        self.users = 0
        self.serial = 0  # its place among the views made (PrefixViews.since)
        self.kv: dict[int, Any] = {}  # model layer slot -> (K, V)
        self.copied = 0  # bytes of K/V copied for the view (0: the pages' own run array)
        for g, blocks in zip(groups, tables):
            pool.hold_all(blocks, VIEW)
            layers = pool.groups[g].layers
            run = pool.run_array(list(blocks), length)
            if run is not None:  # pages restored together: their array is already contiguous
                kv = [(run[i, 0], run[i, 1]) for i in range(len(layers))]
            else:
                kv = [(k[0], v[0]) for k, v in pool.gather_layers(list(blocks), length)]
                self.copied += sum(k.nbytes + v.nbytes for k, v in kv)
            self.kv.update(zip(layers, kv))
        mx.eval([a for kv in self.kv.values() for a in kv])

    def prefix(self, slot: int, n: int) -> tuple[mx.array, mx.array]:
        k, v = self.kv[slot]
        if n == self.length:
            return k, v
        return k[:, :n, :], v[:, :n, :]

    @property
    def nbytes(self) -> int:
        """The memory the view takes beyond its pages' own."""
        return self.copied

    def close(self) -> None:
        for blocks in self.tables:
            self.pool.release_all(blocks, VIEW)
        self.kv.clear()
        self.tables = []


class PrefixViews:
    """The live prefix views of one pool. A sequence starting from >= ``min_pages`` full pages
    uses the live view with the longest common run of pages, or a new one over all its full
    pages; a running sequence takes up a new view of its pages at its next step (``since``), so
    a shared prefix is kept once however the sharing began. A view goes with its last user."""

    def __init__(self, pool: "PagePool", min_pages: int = 2):
        self.pool = pool
        self.min_pages = min_pages
        self.groups = [i for i, g in enumerate(pool.groups) if g.kind.reads_all]
        self.views: list[PrefixView] = []
        self.made = 0  # views made so far: the newest one's serial

    def _full_pages(self, tables: Sequence[Sequence[int | None]], n: int) -> list[tuple]:
        P = self.pool.page_size
        return [tuple(tables[g][: n // P]) for g in self.groups]

    def best(self, tables: Sequence[Sequence[int | None]], n: int) -> tuple[PrefixView | None, int]:
        """The live view sharing the most leading pages with ``tables`` (first ``n`` tokens),
        and how many tokens that is."""
        if not self.groups:
            return None, 0
        mine = self._full_pages(tables, n)[0]
        best, best_pages = None, 0
        for view in self.views:
            theirs, k = view.tables[0], 0
            limit = min(len(theirs), len(mine))
            while k < limit and theirs[k] == mine[k]:
                k += 1
            if k > best_pages:
                best, best_pages = view, k
        return best, best_pages * self.pool.page_size

    def acquire(self, tables: Sequence[Sequence[int | None]],
                n: int) -> tuple[PrefixView | None, int]:
        """A view for a sequence whose first ``n`` tokens are held by ``tables``, and the number
        of its tokens the view covers; ``(None, 0)`` when too short to share. A live view that
        covers at least ``min_pages`` of them is used as far as it goes (the rest goes to the
        sequence's own buffers); otherwise a new view over all the full pages. The caller owns
        one use of the view (``release``)."""
        P = self.pool.page_size
        if not self.groups or n // P < self.min_pages:
            return None, 0
        view, c = self.best(tables, n)
        if c < self.min_pages * P:
            full_pages = self._full_pages(tables, n)
            if not all(self.pool.all_sealed(t) for t in full_pages):
                return None, 0
            view = PrefixView(self.pool, full_pages, n // P * P, self.groups)
            c = n // P * P
            self.made += 1
            view.serial = self.made
            self.views.append(view)
        view.users += 1
        return view, c

    def since(self, seen: int) -> list[PrefixView]:
        """The live views made after the ``seen``-th, oldest first."""
        return [v for v in self.views if v.serial > seen]

    def release(self, view: PrefixView) -> None:
        view.users -= 1
        if view.users <= 0:
            self.views.remove(view)
            view.close()

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views)

    def blocks(self) -> list[int]:
        """The pages the live views hold (each view is one more holder of its pages)."""
        return [b for v in self.views for t in v.tables for b in t]
