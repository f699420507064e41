"""What a manager's user asks of it, answered in plain values: a part of ``CacheManager``
(``manager.py``).

The server reports the cache (``report``, ``describe``) and exports entries (``holding``)
through these, never through the pool, the store or the manager's own tables; and a runner whose
model reads shared prefixes through views turns them on here (``share_prefixes``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict
from typing import Iterator

from kv_cache.model.views import PrefixViews
from kv_cache.tiers.store.tiered import TieredStore


class Queries:
    """(``self.pool``, ``self.store``, ``self.stats``, ``self.views`` are the manager's.)"""

    def share_prefixes(self) -> None:
        """Sequences started from now on read their leading full pages through shared prefix
        views (``kv_cache.model.attention``). Only for a model whose attention that module
        routes and whose batched passes agree with single ones: the caller has checked."""
        if self.views is None:
            self.views = PrefixViews(self.pool)

    def report(self) -> dict:
        """Counters and sizes of both tiers, as plain values (after the pending disk writes)."""
        self.sync()
        pool, m = self.pool, self.stats
        s = pool.stats()
        ram = {"entries": len(self), "pages": s.used_pages, "pages_held": s.held_pages,
               "pages_cached": s.cached_pages, "bytes": s.used_bytes,
               "bytes_shared": s.shared_bytes, "budget_bytes": s.budget_bytes,
               "page_size": s.page_size,
               "resident_sequence_tokens": self.resident_tokens(),
               "prefix_view_bytes": self.views.nbytes if self.views else 0,
               "evictions": s.evictions}
        return {"hits": m.hits, "misses": m.misses, "tokens_served": m.tokens_served,
                "disk_hits": m.disk_hits, "tokens_from_disk": m.tokens_from_disk,
                "pages_read_from_disk": m.pages_read_from_disk, "disk_saves": m.disk_saves,
                "disk_save_failures": m.disk_save_failures, "ram": ram,
                "disk": asdict(self.store.stats()) if self.store is not None else None,
                "disk_enabled": self.store is not None,
                "store": asdict(self.store.shared.stats())
                if isinstance(self.store, TieredStore) else None}

    def describe(self, key: str) -> dict | None:
        """``key``'s entry: its tokens, pages and tiers; None when neither tier holds it."""
        self.sync()
        entry = self.get(key)
        stored = self.store.get(key) if self.store is not None else None
        if entry is None and stored is None:
            return None
        n, P = len(entry.tokens if entry is not None else stored.tokens), self.pool.page_size
        return {"tokens": n, "in_memory": entry is not None, "on_disk": stored is not None,
                "page_size": P, "pages": -(-n // P)}

    @contextmanager
    def holding(self, key: str) -> Iterator[tuple[tuple[int, ...], list, list | None] | None]:
        """``(tokens, tables, state)`` of ``key``'s whole entry, its pages held while the block
        runs (an entry in memory holds its own; one loaded from disk is held for the block):
        from memory, else from disk. None where neither has all of it (a model with recurrent
        state needs the state after its last token too)."""
        self.sync()
        entry = self.get(key)
        tables: list = []
        if entry is not None:
            found = (entry.tokens, entry.tables, entry.state)
        else:
            stored = self.store.get(key) if self.store is not None else None
            n, tables, state = (0, [], None) if stored is None else \
                self._load(stored, len(stored.tokens))
            found = (stored.tokens, tables, state) if n and n == len(stored.tokens) else None
        if found is not None and self.pool.spec.has_state and found[2] is None:
            found = None
        try:
            yield found
        finally:
            for t in tables:
                self.pool.release_all(t)
