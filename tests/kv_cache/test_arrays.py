"""Keyed arrays through the manager (kv_cache/arrays.py): kept in memory within their budget
(least recently used out), written to disk off the calling thread, found there after memory
gave them back or after a restart, bit for bit; counted as hits from memory or disk and
misses; given back first when memory is short."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kv_cache.manager import CacheManager
from kv_cache.pages.pool import PagePool
from kv_cache.tiers.disk.store import DiskStore
from tests.kv_cache.tiers.disk.test_arrays import bit_equal


def pool() -> PagePool:
    return PagePool(2, 2, 8, page_size=4, dtype=mx.float32, max_bytes=1 << 20,
                    fingerprint="tiny")


def manager(root=None, max_arrays_bytes: int = 1 << 20) -> CacheManager:
    p = pool()
    store = None if root is None else DiskStore(root, fingerprint=p.fingerprint, spec=p.spec,
                                                page_size=p.page_size, max_bytes=1 << 26)
    return CacheManager(p, store, max_arrays_bytes=max_arrays_bytes)


def features(seed: int, rows: int = 16) -> dict[str, mx.array]:
    rng = np.random.default_rng(seed)
    return {"features": mx.array(rng.standard_normal((rows, 8)).astype(np.float32))
            .astype(mx.bfloat16),
            "extra": mx.array(rng.standard_normal((2, rows, 8)).astype(np.float32))}


def test_memory_keeps_the_most_recently_used_within_its_budget() -> None:
    one = sum(a.nbytes for a in features(0).values())
    m = manager(max_arrays_bytes=2 * one)
    for k in ("a", "b"):
        m.put_arrays(k, features(ord(k)))
    assert bit_equal(m.get_arrays("a"), features(ord("a")))  # a used: b is the oldest
    m.put_arrays("c", features(ord("c")))
    assert m.get_arrays("b") is None and m.has_arrays("a") and m.has_arrays("c")
    stats = m.report()["arrays"]
    assert stats["entries"] == 2 and stats["bytes"] == 2 * one == stats["budget_bytes"]
    assert (stats["memory_hits"], stats["disk_hits"], stats["misses"]) == (1, 0, 1)
    m.put_arrays("huge", features(9, rows=64))  # larger than the budget alone: not kept
    assert not m.has_arrays("huge") and m.report()["arrays"]["entries"] == 2
    m.close()


def test_the_disk_keeps_them_after_memory_gives_them_back_and_after_a_restart(tmp_path) -> None:
    m = manager(tmp_path)
    m.put_arrays("image:a", features(1))
    m.sync()  # the disk writer has written them
    assert m.report()["arrays"]["disk_saves"] == 1
    m.shed()  # memory short: the arrays held in memory go first
    assert m.report()["arrays"]["bytes"] == 0 and m.has_arrays("image:a")
    assert bit_equal(m.get_arrays("image:a"), features(1))  # from disk
    assert bit_equal(m.get_arrays("image:a"), features(1))  # then from memory again
    stats = m.report()["arrays"]
    assert (stats["memory_hits"], stats["disk_hits"], stats["misses"]) == (1, 1, 0)
    assert m.report()["disk"]["arrays"] == 1
    m.close()
    again = manager(tmp_path)
    assert again.has_arrays("image:a") and again.get_arrays("image:b") is None
    assert bit_equal(again.get_arrays("image:a"), features(1))
    assert again.report()["arrays"]["disk_hits"] == 1
    again.close()


def test_without_a_disk_they_live_in_memory_only() -> None:
    m = manager()
    m.put_arrays("k", features(2))
    m.shed()
    assert not m.has_arrays("k") and m.get_arrays("k") is None
    m.close()
