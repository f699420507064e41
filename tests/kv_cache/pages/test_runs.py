"""Runs (``kv_cache.pages.runs``): consecutive sealed pages added together whose storage is one
array, its bytes counted until the last page of the run goes.
"""

import numpy as np
import pytest

from kv_cache.errors import OutOfBlocksError
from kv_cache.pages.hashing import page_hash

from tests.kv_cache.pages.pool_helpers import P, PAGE_BYTES, kv, make_pool, np_, sealed


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
