"""The shared store's writer with a real redis-server: what it finds present it touches."""

from __future__ import annotations

import time

from kv_cache.pages.hashing import chain_hashes
from tests.kv_cache.tiers.store.test_tiered import (  # noqa: F401 (fixtures)
    NS, TOKENS, a_turn, manager, model, redis_server)


def test_pages_another_entry_shares_are_touched_by_its_write(model, tmp_path, redis_server):
    """A writer finds a shared beginning (a system prompt) present and does not send it again;
    it must still count as used, or the store's LRU drops the pages every conversation starts
    with first (it did: EXISTS leaves a key's access time alone, and a shared page was written
    once)."""
    m = manager(model, tmp_path / "a", redis_server.url)
    a_turn(model, m, TOKENS, "m1")
    time.sleep(2.2)  # the store's LRU clock ticks once a second
    a_turn(model, m, TOKENS[:8] + [3, 4, 5, 6, 7], "m2")  # the first two pages shared
    geo, P, client = m.store.geo, m.pool.page_size, redis_server.client()
    keys = m.store.shared.keys
    hashes = chain_hashes(geo.root(0), TOKENS, P)
    idle = [client.object("idletime", keys.page(h)) for h in hashes]
    assert m.store.shared.stats().pages_written == 7 + 2  # m2: its one new page and its tail
    assert max(idle[:2]) <= 1 and min(idle[2:]) >= 2, idle
    m.close()
