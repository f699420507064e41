"""Holders (``kv_cache.pages.holders``): the pool counts each page's holds by kind of holder, in
step with its ref count.
"""

import pytest

from kv_cache.pages.holders import ENTRY, RESIDENT, SEQUENCE, VIEW

from tests.kv_cache.pages.pool_helpers import make_pool


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
