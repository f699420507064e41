"""Restoring a stored entry into the page pool: what a ``Match`` found on disk, loaded.

The pages an entry's first ``n`` tokens use are held from memory where the pool has them, else
read from disk: page files by hash (a full-attention group's pages that are all missing, as one
array: ``kv_cache.pages.runs``), read ahead in batches; the open tail page from the entry's tail
file (or, for a prefix found by content, the file continuing its last page: ``FoundTails``).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence, TypeVar

import mlx.core as mx

from kv_cache.errors import OutOfBlocksError
from kv_cache.lookup import cut, whole
from kv_cache.model.sequence import Snapshot
from kv_cache.pages.pool import PagePool
from kv_cache.pages.spans import Span, page_extras
from kv_cache.stats import ManagerStats
from kv_cache.tiers.base import FoundPrefix, FoundTails, StoredEntry, Tier

log = logging.getLogger("kv_cache.manager")
PREFETCH_BYTES = 64 << 20  # page data read ahead (in parallel) while restoring an entry
T = TypeVar("T")


class Restore:
    """Loading entries from ``store`` into ``pool``, each page it adds taken through
    ``with_room`` (room made for it where the pool is full: ``Room.with_room``); pages read
    counted in ``stats``."""

    def __init__(self, pool: PagePool, store: Tier | None, stats: ManagerStats,
                 with_room: Callable[[Callable[[], T]], T]):
        self.pool, self.store, self.stats, self.with_room = pool, store, stats, with_room

    def load(self, stored: StoredEntry, n: int) -> tuple[int, list[list[int | None]],
                                                         Snapshot | None]:
        """Hold the pages of ``stored`` that its first ``n`` tokens use, from memory where the
        pool has them, else from disk: ``(tokens covered, tables, state)``. A model with one
        full-attention group keeps what loads up to the first page that cannot be had; any
        other gets all it needs or nothing."""
        loaded = self.store.load_entry(stored.key)  # NOTE: the manifest read and verified
        if loaded is None or loaded.entry.tokens != stored.tokens \
                or loaded.entry.spans != stored.spans:
            return 0, [], None
        state = loaded.state if n == len(stored.tokens) else None
        if self.pool.spec.has_state and state is None:
            return 0, [], None
        return self._load_pages(stored.tokens, stored.group_hashes(), loaded.tails, n, state,
                                stored.key, stored.spans)

    def load_found(self, found: FoundPrefix, prompt: Sequence[int],
                   spans: Sequence[Span] = ()):
        """``load`` for a prefix found on disk by content (of ``prompt`` with image
        ``spans``): no manifest, the pages by hash and the partial page's file only if the load
        gets that far (``FoundTails``)."""
        return self._load_pages(prompt, found.hashes, FoundTails(self.store, self.pool, found),
                                found.tokens, None, "a prompt's stored prefix", spans)

    def _load_pages(self, tokens: Sequence[int], hashes: list[list[bytes | None]], tails,
                    n: int, state: Snapshot | None, what: str, spans: Sequence[Span]):
        """What ``load`` does once it has the manifest: the pages ``hashes`` (per group, of
        ``tokens`` with image ``spans``) and the partial page after them (``tails.get(group)``:
        data holding it)."""
        pool, P = self.pool, self.pool.page_size
        n = whole(pool, n)
        tables: list[list[int | None]] = []
        covered = n
        for g, spec in enumerate(pool.groups):
            if spec.kind.reads_all:
                self._load_run(tokens, hashes[g][: n // P], g, spans)
        fetch = self._prefetcher([h for g, spec in enumerate(pool.groups)
                                  for h in hashes[g][spec.kind.pages(n, P)]
                                  if h is not None and pool.lookup(h) is None])
        try:
            for g, spec in enumerate(pool.groups):
                table: list[int | None] = [None] * spec.kind.first_page(n, P)
                tables.append(table)
                chain: list[bytes] | None = None
                for h in hashes[g][spec.kind.pages(n, P)]:  # what the pool has (a run just read)
                    block = None if h is None else pool.lookup(h)
                    if block is None:
                        break
                    table.append(block)
                pool.hold_all(table)
                for i in range(len(table), -(-n // P)):
                    page = tokens[i * P : (i + 1) * P]
                    if i < len(hashes[g]):
                        h = hashes[g][i]
                        block = None if h is None else pool.lookup(h)
                        if block is not None:
                            pool.hold(block)
                        else:
                            data = None if h is None else fetch(h)
                            if data is None:
                                break
                            if i and hashes[g][i - 1] is not None:
                                parent = hashes[g][i - 1]
                            elif i:
                                chain = chain or pool.chain(tokens[: i * P], g, spans)
                                parent = chain[i - 1]
                            else:
                                parent = pool.roots[g]
                            extras = page_extras(spans, i * P, P)
                            block = self.with_room(
                                lambda: pool.add_sealed(parent, page, data, g, h, extras))
                            self.stats.pages_read_from_disk += 1
                    else:  # the reuse reaches into the open tail page
                        data, k = tails.get(g), n - i * P
                        if data is None:
                            break
                        (block,) = self.with_room(lambda: pool.allocate(1, g))
                        pool.write(block, mx.contiguous(data[:, :, :, :k, :]), page[:k])
                    table.append(block)
                covered = min(covered, len(table) * P)
        except OutOfBlocksError as e:
            log.warning("memory full while loading %s from disk: %s", what, e)
            covered = 0
        single = len(pool.groups) == 1 and pool.groups[0].kind.reads_all and not state
        if covered < n and not single:
            covered = 0
        tables = self._cut_loaded(tables, covered)
        return covered, tables, state

    def _load_run(self, tokens: Sequence[int], hashes: Sequence[bytes], g: int,
                  spans: Sequence[Span] = ()) -> None:
        """Where none of a full-attention group's pages ``hashes`` (from the first) is in
        memory, read them from disk into one array (``kv_cache.pages.runs``: a prefix view over
        them then copies nothing) and cache them in the pool; what cannot be read or placed is
        left to the page-by-page load. ``spans``: the image spans among ``tokens``."""
        pool, P = self.pool, self.pool.page_size
        if len(hashes) < 2 or any(pool.lookup(h) is not None for h in hashes):
            return
        arr, k = self.store.load_run(hashes, g)
        pages = [(h, tokens[i * P : (i + 1) * P]) for i, h in enumerate(hashes[:k])]
        extras = [page_extras(spans, i * P, P) for i in range(k)] if spans else []
        try:
            if k == len(hashes):
                self.with_room(lambda: pool.add_sealed_run(pool.roots[g], pages, arr, g, extras))
            else:  # a page could not be read: the ones before it, each in its own storage
                parent = pool.roots[g]
                for i, (h, page) in enumerate(pages):
                    data = mx.contiguous(arr[:, :, :, i * P : (i + 1) * P, :])
                    x = extras[i] if extras else ()
                    pool.release(self.with_room(
                        lambda: pool.add_sealed(parent, page, data, g, h, x)))
                    parent = h
        except OutOfBlocksError:
            return
        self.stats.pages_read_from_disk += k

    def _prefetcher(self, wanted: list[bytes]) -> Callable[[bytes], mx.array | None]:
        """``fetch(h)``: page ``h`` of ``wanted`` from disk, read ahead in batches of pages that
        the store reads in parallel (a batch bounds the memory held in flight)."""
        at = {h: i for i, h in enumerate(wanted)}
        batch: dict[bytes, mx.array | None] = {}
        ahead = max(1, PREFETCH_BYTES // max(self.pool.group_page_bytes, default=1))

        def fetch(h: bytes) -> mx.array | None:
            if h not in batch:
                i = at.get(h)
                if i is None:
                    return self.store.load_pages([h])[h]
                batch.clear()
                batch.update(self.store.load_pages(wanted[i : i + ahead]))
            return batch.pop(h)
        return fetch

    def _cut_loaded(self, tables, n: int) -> list[list[int | None]]:
        """Release what loaded beyond the first ``n`` positions' needs."""
        keep = cut(self.pool, tables, n) if n else [[] for _ in tables]
        for table, kept in zip(tables, keep):
            for i, b in enumerate(table):
                if b is not None and (i >= len(kept) or kept[i] is None):
                    self.pool.release(b)
        return keep
