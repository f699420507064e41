"""Eviction through the pool: only pages that nothing holds, only leaf pages, in the exact order
of each policy (the policies on their own are in ``test_eviction.py``).
"""

import mlx.core as mx
import pytest

from kv_cache.errors import OutOfBlocksError
from kv_cache.pages.pool import PagePool

from tests.kv_cache.pages.pool_helpers import cached, kv, make_pool, sealed


def test_eviction_takes_only_pages_that_nothing_holds():
    pool = make_pool(2)
    a = sealed(pool, (1, 2))  # held
    b = cached(pool, (3, 4))
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    assert pool.allocate(1) == [b]
    assert pool.ref_count(a) == 1 and pool.match_prefix([1, 2]) == [a]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    assert pool.stats().evictions == 1


@pytest.mark.parametrize("policy, order", [("lru", [1, 0, 2]), ("fifo", [1, 0, 2]),
                                           ("s3fifo", [1, 2, 0])])
def test_eviction_takes_only_leaf_pages(policy, order):
    """A prefix page is never evicted while a cached page continues it."""
    pool = make_pool(3, policy=policy)
    a = cached(pool, (1, 1))  # the oldest: every policy's first choice were it a leaf
    b = cached(pool, (2, 2), parent=pool.hash_of(a))
    c = cached(pool, (3, 3))
    assert (a, b, c) == (0, 1, 2)
    got = [pool.allocate(1)[0] for _ in range(3)]
    assert got == order


def test_evict_all_cached_goes_leaf_first_and_keeps_held_pages():
    pool = make_pool(6)
    evicted = []
    real = pool._evict
    pool._evict = lambda b: (evicted.append(b), real(b))[1]
    a = cached(pool, (1, 1))
    b = cached(pool, (2, 2), parent=pool.hash_of(a))
    c = cached(pool, (3, 3), parent=pool.hash_of(b))
    d = sealed(pool, (4, 4))  # held
    e = cached(pool, (5, 5), parent=pool.hash_of(d))
    assert pool.evict_all_cached() == 4
    assert evicted == [c, b, a, e]
    assert pool.ref_counts() == {d: 1}
    assert pool.match_prefix([4, 4, 5, 5]) == [d]
    assert pool.evict_all_cached() == 0
    assert pool.stats().evictions == 4 and pool.stats().cached_pages == 0


@pytest.mark.parametrize(
    "policy, order",
    [
        ("lru", [2, 3, 1, 0]),  # least recently held first: C, D, B, A
        ("fifo", [0, 1, 2, 3]),  # sealing order, reuse ignored
        ("s3fifo", [2, 3, 0, 1]),  # A, B reused: promoted to main; C, D evicted from small
    ],
)
def test_exact_eviction_order_per_policy(policy, order):
    pool = make_pool(4, policy=policy)
    pages = [cached(pool, (t, t)) for t in range(4)]  # A B C D
    assert pages == [0, 1, 2, 3]
    for b in (0, 1, 0):  # reuse A, then B, then A again
        pool.hold(b)
        pool.release(b)
    got = []
    for _ in range(4):
        (b,) = pool.allocate(1)  # nothing free: the id handed out is the victim's
        got.append(b)
    assert got == order
    assert pool.stats().evictions == 4
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)


def test_s3fifo_ghost_hit_through_the_pool():
    pool = make_pool(2, policy="s3fifo")
    a = cached(pool, (1, 1))
    b = cached(pool, (2, 2))
    assert pool.allocate(1) == [a]  # (1, 1) evicted from small: its hash goes to the ghost
    pool.release(a)
    again = pool.add_sealed(pool.root, (1, 1), kv(2))
    assert list(pool.policy._main) == [again] and list(pool.policy._small) == [b]
    pool.release(again)
    assert pool.allocate(1) == [b]  # the small page goes first


def test_s3fifo_pool_finds_the_cached_page_when_main_is_all_held():
    """Regression: ten held pages in S3-FIFO's main queue hid the one cached page."""
    pool = PagePool(1, 1, 1, page_size=1, dtype=mx.float32, max_bytes=8 * 12, policy="s3fifo")

    def one(token, parent):
        (b,) = pool.allocate(1)
        pool.write(b, mx.full((1, 2, 1, 1, 1), float(token)), [token])
        return pool.seal(b, parent)

    held = []
    for i in range(10):  # one held chain (a sequence of ten tokens)
        held.append(one(i, pool.hash_of(held[-1]) if held else pool.root))
    c = one(100, pool.root)
    pool.release(c)
    assert pool.allocate(1) == [11]
    assert pool.allocate(1) == [c]
    assert all(pool.ref_count(b) == 1 for b in held)
