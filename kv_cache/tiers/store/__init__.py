"""A page store shared by several servers, on Valkey or Redis: a tier below the local disk.

``open_shared`` makes the link (``connection``) and the store (``shared``) for one model;
``TieredStore`` (``tiered``) puts it under the disk tier, as the one tier the manager sees.
The client library is imported only here, when a store is asked for.
"""

from __future__ import annotations

import logging

from kv_cache.tiers.disk.file_format import Geometry
from kv_cache.tiers.store.connection import Breaker, Link, StoreUnavailable, normalize_url, redact
from kv_cache.tiers.store.shared import SharedStore, StoreStats, WriteJob
from kv_cache.tiers.store.tiered import TieredStore

__all__ = ["Breaker", "Link", "SharedStore", "StoreStats", "StoreUnavailable", "TieredStore",
           "WriteJob", "below_disk", "normalize_url", "open_shared", "redact"]
log = logging.getLogger("kv_cache.store")


def open_shared(url: str, geo: Geometry, namespace: str = "kv", *, connect_timeout: float = 0.5,
                timeout: float = 2.0, fail_limit: int | None = None,
                cool_down: float | None = None) -> SharedStore:
    """The shared store at ``url`` for the model of ``geo``. A bad URL is a ``ValueError``; a
    store that cannot be used now (down, wrong password) is a warning, not an error: it is
    asked again once its breaker lets it (``Link.check``)."""
    normalize_url(url)
    link = Link(url, connect_timeout, timeout, Breaker(fail_limit, cool_down))
    link.check()
    return SharedStore(link, geo, namespace)


def below_disk(disk, url: str, namespace: str, geo: Geometry):
    """``disk`` with the shared store at ``url`` below it (``TieredStore``); ``disk`` as it is
    when there is no disk tier (the store sits below it: a warning says it is not used)."""
    if disk is None:
        log.warning("kv store %s not used: it sits below the disk cache, which is off",
                    redact(url))
        return None
    return TieredStore(disk, open_shared(url, geo, namespace))
