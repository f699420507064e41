"""PagePool: the byte budget, allocate / hold / release, writes, copy-on-write copies, running
out (the caller makes room) and what ``stats`` reports.

Seals and lookups by content are in ``test_sealing.py`` and ``test_prefix_index.py``, page data in
``test_storage.py`` and ``test_runs.py``, holders by kind in ``test_holders.py``, eviction through
the pool in ``test_pool_eviction.py``.
"""

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.errors import InvalidBlockError, OutOfBlocksError
from kv_cache.pages.eviction import LRUPolicy
from kv_cache.pages.holders import ENTRY
from kv_cache.pages.pool import PagePool

from tests.kv_cache.pages.pool_helpers import (D, H, L, P, PAGE_BYTES, cached, kv, make_pool, np_,
                                               sealed)


# -- construction and budget -----------------------------------------------------------------------


def test_page_bytes_and_capacity_follow_the_byte_budget():
    pool = PagePool(L, H, D, page_size=P, dtype=mx.float32, max_bytes=PAGE_BYTES * 5 + 63)
    assert pool.page_bytes == 64
    assert pool.capacity == 5 == pool.allocator.num_blocks
    f16 = PagePool(3, 4, 8, page_size=16, dtype=mx.float16, max_bytes=10_000_000)
    assert f16.page_bytes == 3 * 2 * 4 * 16 * 8 * 2
    assert f16.capacity == 10_000_000 // f16.page_bytes
    assert PagePool(L, H, D, page_size=P, max_bytes=PAGE_BYTES - 1, dtype=mx.float32).capacity == 0


@pytest.mark.parametrize("dims", [(0, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0)])
def test_dimensions_must_be_positive(dims):
    layers, heads, head_dim, page_size = dims
    with pytest.raises(ValueError):
        PagePool(layers, heads, head_dim, page_size=page_size)


def test_unknown_policy_name_is_rejected_and_a_policy_object_is_used_as_is():
    with pytest.raises(ValueError):
        make_pool(2, policy="nope")
    policy = LRUPolicy()
    pool = make_pool(2, policy=policy)
    assert pool.policy is policy
    b = sealed(pool, (1, 2))
    assert b in policy


def test_no_room_at_all():
    pool = make_pool(0)
    assert pool.capacity == 0 and not pool.can_allocate(1) and pool.allocate(0) == []
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)


def test_used_bytes_stay_within_the_budget():
    pool = make_pool(3)
    for i in range(10):  # more sealed pages than fit: old ones are evicted
        cached(pool, (i, i))
        assert pool.stats().used_bytes <= pool.max_bytes
    st = pool.stats()
    assert (st.used_pages, st.cached_pages, st.evictions) == (3, 3, 7)
    assert st.used_bytes == 3 * PAGE_BYTES


def test_stats_report_shared_bytes_and_the_budget():
    pool = make_pool(4)
    a = sealed(pool, (1, 2))
    b = cached(pool, (3, 4), parent=pool.hash_of(a))
    pool.hold(a, ENTRY)
    st = pool.stats()
    assert (st.used_pages, st.held_pages, st.cached_pages, st.sealed_pages) == (2, 1, 1, 2)
    assert (st.shared_bytes, st.used_bytes, st.budget_bytes) == (PAGE_BYTES, 2 * PAGE_BYTES,
                                                                 4 * PAGE_BYTES)
    assert pool.ref_count(b) == 0


# -- allocate / hold / release ---------------------------------------------------------------------


def test_allocate_hands_out_exact_ids_held_once_and_open():
    pool = make_pool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    for b in (0, 1, 2):
        assert pool.ref_count(b) == 1
        assert not pool.is_sealed(b)
        assert pool.num_tokens(b) == 0 and pool.tokens(b) == ()
        assert pool.hash_of(b) is None
    assert pool.ref_counts() == {0: 1, 1: 1, 2: 1}


def test_allocate_is_all_or_none_and_everything_held_is_out_of_blocks():
    pool = make_pool(3)
    pool.allocate(2)
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    assert pool.ref_counts() == {0: 1, 1: 1}
    assert pool.allocate(1) == [2]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_hold_and_release_count_holders():
    pool = make_pool(2)
    (b,) = pool.allocate(1)
    pool.hold(b)
    pool.hold(b)
    assert pool.ref_count(b) == 3
    pool.release(b)
    assert pool.ref_count(b) == 2
    assert pool.stats().held_pages == 1


def test_hold_all_and_release_all_are_hold_and_release_per_page():
    pool = make_pool(4)
    a, b = pool.allocate(2)
    c = cached(pool, (1, 2))
    pool.hold_all([a, None, c, a])
    assert (pool.ref_count(a), pool.ref_count(b), pool.ref_count(c)) == (3, 1, 1)
    assert pool.stats().cached_pages == 0
    pool.release_all([c, None, a, a, b])
    assert pool.ref_count(a) == 1 and pool.ref_count(c) == 0 and pool.stats().cached_pages == 1
    assert not pool.allocator.is_allocated(b)  # an open page nothing holds is freed
    with pytest.raises(InvalidBlockError):
        pool.hold_all([a, b])


def test_a_released_open_page_is_freed():
    pool = make_pool(2)
    a, b = pool.allocate(2)
    pool.write(a, kv(1), [5])
    pool.hold(a)
    pool.release(a)
    assert pool.ref_count(a) == 1
    pool.release(a)
    assert not pool.allocator.is_allocated(a)
    assert a not in pool.ref_counts() and a not in pool.storage.arrays
    with pytest.raises(InvalidBlockError):
        pool.ref_count(a)
    with pytest.raises(InvalidBlockError):
        pool.release(a)
    with pytest.raises(InvalidBlockError):
        pool.hold(a)
    assert pool.allocate(1) == [a]  # its id is free again
    assert pool.tokens(a) == ()  # and it comes back empty


def test_a_released_sealed_page_stays_cached_and_is_found_again():
    pool = make_pool(3)
    b = sealed(pool, (4, 5))
    pool.release(b)
    assert pool.ref_count(b) == 0 and pool.is_sealed(b)
    assert pool.allocator.is_allocated(b)
    st = pool.stats()
    assert (st.used_pages, st.held_pages, st.cached_pages, st.sealed_pages) == (1, 0, 1, 1)
    assert pool.match_prefix([4, 5, 6]) == [b]
    assert pool.ref_count(b) == 0  # match_prefix does not hold
    pool.hold(b)
    assert pool.ref_count(b) == 1 and pool.stats().cached_pages == 0
    pool.release(b)
    assert pool.ref_count(b) == 0 and pool.stats().cached_pages == 1


def test_release_of_a_cached_page_is_a_broken_invariant():
    pool = make_pool(2)
    b = cached(pool, (1, 2))
    with pytest.raises(AssertionError, match="nothing holds"):
        pool.release(b)


# -- write -----------------------------------------------------------------------------------------


def test_write_appends_data_and_tokens():
    pool = make_pool(2)
    (b,) = pool.allocate(1)
    assert pool.is_writable(b, 0) and not pool.is_writable(b, 1)
    pool.write(b, kv(1, 0.0), [7])
    assert pool.tokens(b) == (7,) and pool.num_tokens(b) == 1
    assert pool.is_writable(b, 1) and not pool.is_writable(b, 0)
    pool.write(b, kv(1, 100.0), np.array([8]))
    assert pool.tokens(b) == (7, 8)
    assert type(pool.tokens(b)[1]) is int
    expected = np.concatenate([np_(kv(1, 0.0)), np_(kv(1, 100.0))], axis=3)
    assert pool.data(b).shape == (L, 2, H, 2, D)
    assert np.array_equal(np_(pool.data(b)), expected)


def test_write_casts_to_the_pool_dtype():
    pool = PagePool(L, H, D, page_size=P, dtype=mx.float16, max_bytes=1 << 16)
    (b,) = pool.allocate(1)
    pool.write(b, kv(2) + 0.1, [1, 2])
    assert pool.data(b).dtype == mx.float16


def test_write_misuse():
    pool = make_pool(2)
    (b,) = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.write(b, kv(2), [1])  # shape does not match the tokens
    with pytest.raises(ValueError):
        pool.write(b, mx.zeros((L, 2, H + 1, 1, D)), [1])
    with pytest.raises(ValueError):
        pool.write(b, kv(3), [1, 2, 3])  # more than a page
    pool.write(b, kv(1), [1])
    with pytest.raises(ValueError):
        pool.write(b, kv(2), [2, 3])  # room for one more only
    assert pool.tokens(b) == (1,)
    with pytest.raises(InvalidBlockError):
        pool.write(1, kv(1), [1])  # not allocated


def test_write_to_a_sealed_page_is_an_assertion():
    pool = make_pool(2)
    b = sealed(pool, (1, 2))
    before = np_(pool.data(b))
    with pytest.raises(AssertionError, match="sealed"):
        pool.write(b, kv(1), [3])
    assert not pool.is_writable(b, 2)
    assert pool.tokens(b) == (1, 2) and np.array_equal(np_(pool.data(b)), before)


def test_write_to_a_page_held_twice_is_an_assertion():
    pool = make_pool(2)
    (b,) = pool.allocate(1)
    pool.write(b, kv(1), [1])
    pool.hold(b)
    assert not pool.is_writable(b, 1)
    with pytest.raises(AssertionError, match="held 2 times"):
        pool.write(b, kv(1), [2])
    assert pool.tokens(b) == (1,)


# -- copy ------------------------------------------------------------------------------------------


def test_copy_makes_an_open_private_page():
    pool = make_pool(4)
    a = sealed(pool, (1, 2), base=3.0)
    before = np_(pool.data(a))
    c = pool.copy(a, 1)
    assert c != a
    assert (pool.tokens(c), pool.ref_count(c), pool.is_sealed(c)) == ((1,), 1, False)
    assert np.array_equal(np_(pool.data(c)), before[:, :, :, :1, :])
    assert pool.is_writable(c, 1)
    pool.write(c, kv(1, 77.0), [9])
    assert pool.tokens(c) == (1, 9)
    assert pool.tokens(a) == (1, 2) and np.array_equal(np_(pool.data(a)), before)
    assert pool.ref_count(a) == 1
    full = pool.copy(a)
    assert pool.tokens(full) == (1, 2) and np.array_equal(np_(pool.data(full)), before)


@pytest.mark.parametrize("n", [0, 3, -1])
def test_copy_misuse(n):
    pool = make_pool(3)
    a = sealed(pool, (1, 2))
    with pytest.raises(ValueError):
        pool.copy(a, n)
    assert pool.stats().used_pages == 1


def test_copy_under_pressure_never_evicts_its_source():
    pool = make_pool(2)
    a = cached(pool, (1, 2), base=10.0)  # older: LRU's first choice
    b = cached(pool, (3, 4))
    c = pool.copy(a, 2)
    assert c == b  # b was evicted to make room, not the source
    assert pool.match_prefix([3, 4]) == []
    assert pool.ref_count(a) == 0 and pool.match_prefix([1, 2]) == [a]
    assert np.array_equal(np_(pool.data(c)), np_(kv(2, 10.0)))


def test_copy_of_a_held_page_fails_cleanly_when_full():
    pool = make_pool(1)
    (a,) = pool.allocate(1)
    pool.write(a, kv(1), [1])
    with pytest.raises(OutOfBlocksError):
        pool.copy(a)
    assert pool.ref_count(a) == 1  # the temporary hold was dropped


# -- running out: the caller makes room ------------------------------------------------------------


def test_running_out_says_what_was_needed_and_changes_nothing():
    pool = make_pool(2)
    a, b = pool.allocate(2)
    with pytest.raises(OutOfBlocksError) as e:
        pool.allocate(1)
    assert (e.value.pages, e.value.group) == (1, 0)
    assert pool.ref_counts() == {a: 1, b: 1}
    pool.release(a)  # the caller makes room (CacheManager.make_room drops holders) ...
    assert pool.allocate(1) == [a]  # ... and tries again


def test_free_or_cached_pages_suffice_without_the_caller():
    pool = make_pool(3)
    pool.allocate(1)
    b = cached(pool, (1, 2))
    pool.allocate(1)  # the last free page
    assert pool.allocate(1) == [b]  # evicts the cached page


def test_running_out_of_leaves_says_what_was_needed_too():
    """Cached pages that a held page continues are not leaves: not evictable yet."""
    pool = make_pool(2)
    a = cached(pool, (1, 2))
    b = sealed(pool, (3, 4), parent=pool.hash_of(a))
    assert pool.can_allocate(1)
    with pytest.raises(OutOfBlocksError, match="continued") as e:
        pool.allocate(1)
    assert (e.value.pages, e.value.group) == (1, 0)
    assert pool.ref_counts() == {a: 0, b: 1}
