"""PagePool: allocation, holders (by kind), seals, dedup, copy-on-write support, gather, byte
budget, running out (the caller makes room) and eviction (only unheld leaf pages, exact order per
policy)."""

import mlx.core as mx
import numpy as np
import pytest

import kv_cache.pages.prefix_index as prefix_index_mod
import kv_cache.pages.sealing as sealing_mod
from kv_cache.errors import InvalidBlockError, OutOfBlocksError
from kv_cache.pages.eviction import LRUPolicy
from kv_cache.pages.hashing import page_hash, root_hash
from kv_cache.pages.holders import ENTRY, RESIDENT, SEQUENCE, VIEW
from kv_cache.pages.pool import PagePool

L, H, D, P = 2, 1, 2, 2
PAGE_BYTES = L * 2 * H * P * D * 4  # float32: 64 bytes


def make_pool(pages: int, policy="lru", **kw) -> PagePool:
    return PagePool(L, H, D, page_size=P, dtype=mx.float32, max_bytes=PAGE_BYTES * pages,
                    policy=policy, **kw)


def kv(n: int, base: float = 0.0) -> mx.array:
    return (mx.arange(L * 2 * H * n * D, dtype=mx.float32) + base).reshape(L, 2, H, n, D)


def sealed(pool: PagePool, tokens, parent=None, base=0.0) -> int:
    """A full page written with ``tokens`` and sealed; held once by the caller."""
    (b,) = pool.allocate(1)
    pool.write(b, kv(len(tokens), base), tokens)
    return pool.seal(b, pool.root if parent is None else parent)


def cached(pool: PagePool, tokens, parent=None, base=0.0) -> int:
    b = sealed(pool, tokens, parent, base)
    pool.release(b)
    return b


def np_(a: mx.array) -> np.ndarray:
    return np.array(a)


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


# -- write / seal ----------------------------------------------------------------------------------


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


def test_same_tokens_under_another_parent_is_another_page():
    pool = make_pool(4)
    a = sealed(pool, (1, 2))
    b = sealed(pool, (1, 2), parent=pool.hash_of(a))
    assert b != a and pool.ref_count(a) == 1 and pool.ref_count(b) == 1
    assert pool.match_prefix([1, 2, 1, 2]) == [a, b]


def test_a_hash_hit_compares_tokens_too(monkeypatch):
    """With every hash colliding, only the tokens can tell pages apart."""
    for mod in (sealing_mod, prefix_index_mod):
        monkeypatch.setattr(mod, "page_hash", lambda parent, tokens: b"collision")
    pool = make_pool(4)
    a = sealed(pool, (1, 2))
    b = sealed(pool, (3, 4))
    assert b != a  # not deduplicated onto a page with other tokens
    assert pool.is_sealed(b) and pool.hash_of(b) == pool.hash_of(a)
    assert pool.match_prefix([1, 2]) == [a]
    assert pool.match_prefix([3, 4]) == []  # b is not indexed, a's tokens differ
    pool.release(b)  # not indexed: not cached, freed
    assert not pool.allocator.is_allocated(b)
    pool.release(a)
    assert pool.stats().cached_pages == 1
    c = pool.add_sealed(pool.root, (3, 4), kv(2))
    assert c != a and pool.ref_count(a) == 0


def test_add_sealed_builds_or_reuses_a_sealed_page():
    pool = make_pool(3)
    a = pool.add_sealed(pool.root, (5, 6), kv(2, 1.0))
    assert pool.is_sealed(a) and pool.ref_count(a) == 1 and pool.tokens(a) == (5, 6)
    assert np.array_equal(np_(pool.data(a)), np_(kv(2, 1.0)))
    assert pool.add_sealed(pool.root, (5, 6), kv(2, 9.0)) == a
    assert pool.ref_count(a) == 2
    assert np.array_equal(np_(pool.data(a)), np_(kv(2, 1.0)))
    assert pool.stats().used_pages == 1


# -- copy and gather -------------------------------------------------------------------------------


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


def test_gather_concatenates_pages():
    pool = make_pool(4)
    a = sealed(pool, (1, 2), base=0.0)
    b = sealed(pool, (3, 4), parent=pool.hash_of(a), base=100.0)
    (c,) = pool.allocate(1)
    pool.write(c, kv(1, 200.0), [5])
    full = np.concatenate([np_(kv(2, 0.0)), np_(kv(2, 100.0)), np_(kv(1, 200.0))], axis=3)
    assert np.array_equal(np_(pool.gather([a, b, c], 5)), full)
    assert np.array_equal(np_(pool.gather([a, b], 3)), full[:, :, :, :3])
    assert np.array_equal(np_(pool.gather([a], 1)), full[:, :, :, :1])
    assert pool.gather([a, b], 4).shape == (L, 2, H, 4, D)


@pytest.mark.parametrize("blocks, n", [([0, 1], 2), ([0, 1], 5), ([0], 3), ([0, 2], 4)])
def test_gather_rejects_a_token_count_that_does_not_fit(blocks, n):
    pool = make_pool(4)
    a = sealed(pool, (1, 2))
    b = sealed(pool, (3, 4), parent=pool.hash_of(a))
    (c,) = pool.allocate(1)
    pool.write(c, kv(1), [5])
    assert (a, b, c) == (0, 1, 2)
    with pytest.raises(ValueError):
        pool.gather(blocks, n)  # [0, 2] with 4: block 2 holds only 1 token


# -- storage grows on demand -----------------------------------------------------------------------


def test_storage_exists_only_for_written_pages():
    pool = make_pool(1000)
    assert pool.capacity == 1000 and len(pool.storage.arrays) == 0
    blocks = pool.allocate(10)
    assert len(pool.storage.arrays) == 0
    pool.write(blocks[3], kv(1), [1])
    assert list(pool.storage.arrays) == [blocks[3]]
    pool.release(blocks[3])
    assert len(pool.storage.arrays) == 0


def test_a_large_budget_reserves_no_memory():
    mx.eval(mx.zeros(1))
    before = mx.get_active_memory()
    pool = PagePool(32, 8, 128, page_size=32, dtype=mx.float16, max_bytes=8 << 30)
    assert pool.page_bytes == 4 << 20 and pool.capacity == 2048
    blocks = pool.allocate(500)  # ids only: 2 GiB of pages if storage were reserved
    assert len(blocks) == 500
    assert mx.get_active_memory() - before < (1 << 20)
    assert len(pool.storage.arrays) == 0


def test_used_bytes_stay_within_the_budget():
    pool = make_pool(3)
    for i in range(10):  # more sealed pages than fit: old ones are evicted
        cached(pool, (i, i))
        assert pool.stats().used_bytes <= pool.max_bytes
    st = pool.stats()
    assert (st.used_pages, st.cached_pages, st.evictions) == (3, 3, 7)
    assert st.used_bytes == 3 * PAGE_BYTES


# -- running out: the caller makes room -----------------------------------------------------------


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


# -- holders by kind -------------------------------------------------------------------------------


def test_holds_are_counted_by_kind_of_holder():
    pool = make_pool(4)
    a, b = pool.allocate(2)  # a sequence's pages
    pool.hold(a, ENTRY)
    pool.hold_all([a, None, b], VIEW)
    assert pool.holders.of(a) == {SEQUENCE: 1, ENTRY: 1, VIEW: 1}
    assert sum(pool.holders.of(a).values()) == pool.ref_count(a) == 3
    pool.holders.move([a, None], SEQUENCE, RESIDENT)  # the sequence is kept resident
    assert pool.holders.held_by(SEQUENCE) == {b: 1} and pool.holders.held_by(RESIDENT) == {a: 1}
    assert pool.ref_count(a) == 3
    with pytest.raises(AssertionError, match="does not hold"):
        pool.release(a)  # no running sequence holds it now
    with pytest.raises(ValueError, match="kind of holder"):
        pool.hold(a, "friend")
    pool.release(a, RESIDENT)
    pool.release(a, ENTRY)
    pool.release_all([a, b], VIEW)
    pool.release(b)
    assert pool.ref_counts() == {}  # open pages: freed at zero
    assert all(pool.holders.held_by(k) == {} for k in (SEQUENCE, RESIDENT, ENTRY, VIEW))


def test_a_moved_hold_needs_a_hold_to_move():
    pool = make_pool(2)
    (a,) = pool.allocate(1)
    with pytest.raises(AssertionError, match="no entry hold"):
        pool.holders.move([a], ENTRY, VIEW)
    assert pool.holders.of(a) == {SEQUENCE: 1}


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


# -- eviction --------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("n", [1, P, 2 * P + 1, 3 * P])
def test_gather_layers_with_and_without_room_hold_the_same_positions(n):
    """Per layer, keys and values of the first ``n`` positions, the same whether gathered
    into buffers with room (one copy per layer) or for a read-only view (one copy for all
    layers, sliced per layer)."""
    pool = make_pool(8)
    blocks, parent = [], None
    for i in range(-(-n // P)):
        blocks.append(sealed(pool, list(range(i * P, (i + 1) * P)), parent, base=100.0 * i))
        parent = pool.hash_of(blocks[-1])
    whole = np_(pool.gather(blocks, n))  # [layers, 2, heads, n, head_dim]
    for room in (0, 3):
        got = pool.gather_layers(blocks, n, room)
        assert len(got) == L
        for layer, (k, v) in enumerate(got):
            assert k.shape == v.shape == (1, H, n + room, D)
            assert np.array_equal(np_(k)[0, :, :n], whole[layer, 0])
            assert np.array_equal(np_(v)[0, :, :n], whole[layer, 1])
            assert not np_(k)[0, :, n:].any() and not np_(v)[0, :, n:].any()


def test_a_run_of_pages_is_one_array_and_its_bytes_go_with_its_last_page():
    pool = make_pool(6)
    tokens = [list(range(i * P, (i + 1) * P)) for i in range(3)]
    hashes, parent = [], pool.root
    for t in tokens:
        parent = page_hash(parent, t)
        hashes.append(parent)
    array = kv(3 * P, base=7.0)
    blocks = pool.add_sealed_run(pool.root, list(zip(hashes, tokens)), array)
    assert [pool.lookup(h) for h in hashes] == blocks
    assert all(pool.ref_count(b) == 0 and pool.is_sealed(b) for b in blocks)  # cached
    for i, b in enumerate(blocks):
        assert np.array_equal(np_(pool.data(b)), np_(array)[:, :, :, i * P : (i + 1) * P])
    assert pool.run_array(blocks, 3 * P) is array
    assert pool.run_array(blocks[:2], 2 * P) is None and pool.run_array(blocks, 3 * P - 1) is None
    used = pool.stats().used_bytes
    assert used == 3 * PAGE_BYTES and pool.allocator.num_free == 3
    # Evicted one by one (leaves first): the array is held until its last page goes.
    for gone in (1, 2):
        pool._evict(pool.policy.victim(pool._can_evict))
        assert len(pool.ref_counts()) == 3 - gone
        assert pool.stats().used_bytes == used and pool.allocator.num_free == 3
    assert pool.evict_all_cached() == 1
    assert pool.stats().used_bytes == 0 and pool.allocator.num_free == 6


def test_a_run_must_fit_and_must_be_new():
    pool = make_pool(2)
    tokens = [list(range(i * P, (i + 1) * P)) for i in range(3)]
    hashes = [page_hash(pool.root, tokens[0])]
    hashes += [page_hash(hashes[0], tokens[1]), page_hash(page_hash(hashes[0], tokens[1]),
                                                          tokens[2])]
    with pytest.raises(OutOfBlocksError):
        pool.add_sealed_run(pool.root, list(zip(hashes, tokens)), kv(3 * P))
    assert pool.stats().used_bytes == 0 and pool.allocator.num_free == 2
    with pytest.raises(ValueError, match="only full pages"):  # checked before anything moves
        pool.add_sealed_run(pool.root, [(hashes[0], tokens[0][:-1])], kv(P))
    assert pool.stats().used_bytes == 0 and pool.allocator.num_free == 2
    assert pool.lookup(hashes[0]) is None
    sealed(pool, tokens[0])
    with pytest.raises(AssertionError):
        pool.add_sealed_run(pool.root, list(zip(hashes[:2], tokens[:2])), kv(2 * P))
