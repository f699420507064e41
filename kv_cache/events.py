"""Watching which pages each tier holds (``watch_pages``), for a publisher of KV cache events;
the observer, the pages it is told of and the media are ``kv_cache.pages.events``'."""

from __future__ import annotations

from kv_cache.manager import CacheManager
from kv_cache.pages.events import MEDIUM_RAM, CacheEvents, in_chain_order
from kv_cache.tiers.store.tiered import TieredStore


def watch_pages(manager: CacheManager, events: CacheEvents | None) -> None:
    """Tell ``events`` of every page ``manager``'s tiers hold now (parents before children),
    then of every page stored and removed from now on. ``events`` None: stop telling the
    observer watching until now, which is told first that the pages in memory are removed (they
    go with the manager; the disk's and the store's stay). Call it from the generating thread
    (the pool is read here) while it runs nothing."""
    pool, store = manager.pool, manager.store
    disk = store.disk if isinstance(store, TieredStore) else store
    if events is None:
        watching = pool.events
        pool.events = None
        gone = [p.hash for p in pool.stored_pages()]
        if watching is not None and gone:
            watching.removed(MEDIUM_RAM, gone)
    else:
        ram = in_chain_order(pool.stored_pages())
        if ram:
            events.stored(MEDIUM_RAM, ram)
        pool.events = events
    if disk is not None:
        disk.watch(events)
    if isinstance(store, TieredStore):
        store.shared.events = events
