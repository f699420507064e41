"""Sealing (``PagePool.seal``, ``add_sealed``): a full page sealed once, hashed on its chain,
deduplicated onto an identical page (reviving a cached one), and sealed pages added from outside.
"""

import numpy as np
import pytest

from kv_cache.pages.hashing import page_hash, root_hash

from tests.kv_cache.pages.pool_helpers import cached, kv, make_pool, np_, sealed


def test_seal_hashes_indexes_and_chains():
    pool = make_pool(3, fingerprint="model-a")
    assert pool.root == root_hash("model-a") != root_hash("model-b")
    a = sealed(pool, (1, 2))
    assert pool.is_sealed(a)
    assert pool.hash_of(a) == page_hash(pool.root, (1, 2))
    b = sealed(pool, (3, 4), parent=pool.hash_of(a))
    assert pool.hash_of(b) == page_hash(pool.hash_of(a), (3, 4))
    assert pool.match_prefix([1, 2, 3, 4, 5]) == [a, b]
    assert pool.match_prefix([1, 2, 3]) == [a]  # a partial page never matches
    assert pool.match_prefix([1, 2, 3, 5]) == [a]
    assert pool.match_prefix([3, 4]) == []  # (3, 4) exists only after (1, 2)
    assert pool.match_prefix([]) == []


def test_seal_misuse():
    pool = make_pool(3)
    (b,) = pool.allocate(1)
    pool.write(b, kv(1), [1])
    with pytest.raises(ValueError, match="full"):
        pool.seal(b, pool.root)
    assert not pool.is_sealed(b)
    pool.write(b, kv(1), [2])
    pool.hold(b)
    with pytest.raises(AssertionError):
        pool.seal(b, pool.root)  # held twice
    pool.release(b)
    assert pool.seal(b, pool.root) == b
    with pytest.raises(AssertionError, match="sealed already"):
        pool.seal(b, pool.root)


def test_seal_dedups_an_identical_page():
    pool = make_pool(3)
    a = sealed(pool, (1, 2), base=0.0)
    a_data = np_(pool.data(a))
    (b,) = pool.allocate(1)
    pool.write(b, kv(2, base=500.0), [1, 2])
    assert pool.seal(b, pool.root) == a  # the existing block, the caller's hold moved to it
    assert pool.ref_count(a) == 2
    assert not pool.allocator.is_allocated(b) and b not in pool.storage.arrays
    assert np.array_equal(np_(pool.data(a)), a_data)
    assert pool.stats().used_pages == 1


def test_seal_dedup_revives_a_cached_page():
    pool = make_pool(3)
    a = cached(pool, (1, 2))
    assert pool.stats().cached_pages == 1
    (b,) = pool.allocate(1)
    pool.write(b, kv(2), [1, 2])
    assert pool.seal(b, pool.root) == a
    assert pool.ref_count(a) == 1 and pool.stats().cached_pages == 0


def test_add_sealed_builds_or_reuses_a_sealed_page():
    pool = make_pool(3)
    a = pool.add_sealed(pool.root, (5, 6), kv(2, 1.0))
    assert pool.is_sealed(a) and pool.ref_count(a) == 1 and pool.tokens(a) == (5, 6)
    assert np.array_equal(np_(pool.data(a)), np_(kv(2, 1.0)))
    assert pool.add_sealed(pool.root, (5, 6), kv(2, 9.0)) == a
    assert pool.ref_count(a) == 2
    assert np.array_equal(np_(pool.data(a)), np_(kv(2, 1.0)))
    assert pool.stats().used_pages == 1
