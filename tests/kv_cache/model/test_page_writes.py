"""Writing a sequence's positions into pages (``kv_cache.model.page_writes``, through
``PagedSequence.commit``): new pages, the open tail page in place, full pages sealed and
stored once, and a shared tail page copied before a write.
"""

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.errors import OutOfBlocksError
from kv_cache.pages.hashing import page_hash
from kv_cache.model.sequence import PagedSequence

from tests.kv_cache.model.sequence_helpers import (D, H, TOKS, Run, committed_run, make_pool, same,
                                                   snapshot)


# -- commit ----------------------------------------------------------------------------------------


def test_commit_writes_pages_and_seals_full_ones():
    pool = make_pool()
    r = committed_run(pool)
    seq = r.seq
    assert seq.table.blocks == [0, 1, 2]
    assert [pool.is_sealed(b) for b in (0, 1, 2)] == [True, True, False]
    assert [pool.tokens(b) for b in (0, 1, 2)] == [tuple(TOKS[0:4]), tuple(TOKS[4:8]),
                                                   tuple(TOKS[8:10])]
    assert pool.ref_counts() == {0: 1, 1: 1, 2: 1}
    assert seq.committed == 10 and len(seq) == 10 and seq.offset == 10
    assert pool.hash_of(0) == page_hash(pool.root, TOKS[0:4])
    assert pool.hash_of(1) == page_hash(pool.hash_of(0), TOKS[4:8])
    assert pool.match_prefix(TOKS) == [0, 1]
    r.check()


def test_nothing_reaches_the_pool_before_commit_and_commit_is_idempotent():
    pool = make_pool()
    r = Run(PagedSequence(pool))
    r.feed(TOKS[:5])
    assert pool.stats().used_pages == 0 and r.seq.committed == 0
    r.seq.commit()
    r.seq.commit()
    assert r.seq.table.blocks == [0, 1] and pool.stats().used_pages == 2
    r.check()


def test_open_tail_page_is_written_in_place():
    pool = make_pool()
    r = Run(PagedSequence(pool))
    r.feed(TOKS[:3])
    r.seq.commit()
    assert r.seq.table.blocks == [0] and pool.tokens(0) == tuple(TOKS[:3])
    r.feed(TOKS[3:5])  # fills page 0, starts page 1
    r.seq.commit()
    assert r.seq.table.blocks == [0, 1] and pool.is_sealed(0)
    r.feed(TOKS[5:6])
    r.seq.commit()
    assert r.seq.table.blocks == [0, 1] and pool.tokens(1) == tuple(TOKS[4:6])
    assert pool.stats().used_pages == 2  # no copy was made
    r.check()


def test_commit_under_pressure_raises_and_can_be_retried():
    pool = make_pool(pages=2)
    blocker = pool.allocate(1)
    r = Run(PagedSequence(pool))
    r.feed(TOKS[:6])
    with pytest.raises(OutOfBlocksError):
        r.seq.commit()  # needs 2 pages, 1 free: all or none
    assert r.seq.committed == 0 and r.seq.table.blocks == [] and pool.ref_counts() == {0: 1}
    pool.release(blocker[0])
    r.seq.commit()
    assert r.seq.table.blocks == [1, 0]
    r.check()


def test_append_tokens_must_match_the_positions():
    pool = make_pool()
    seq = PagedSequence(pool)
    k = mx.zeros((1, H, 2, D))
    for layer in seq.layers:
        layer.update_and_fetch(k, k)
    with pytest.raises(AssertionError):
        seq.append_tokens([1, 2, 3])


def test_full_pages_of_two_sequences_are_stored_once():
    pool = make_pool()
    a = committed_run(pool, seed=1)
    b = committed_run(pool, seed=2)  # same tokens, other (fake) data
    # b's pages 3 and 4 were sealed onto a's 0 and 1 (and freed); its open tail is private.
    assert b.seq.table.blocks == [0, 1, 5]
    assert pool.ref_counts() == {0: 2, 1: 2, 2: 1, 5: 1}
    assert not pool.allocator.is_allocated(3) and not pool.allocator.is_allocated(4)
    a.check()
    # The shared pages keep the first writer's data: same tokens, same KV (a real model).
    got = np.array(pool.gather(b.seq.table.blocks, 10))
    np.testing.assert_array_equal(got[:, :, :, :8], a.kv[:, :, :, :8])
    np.testing.assert_array_equal(got[:, :, :, 8:], b.kv[:, :, :, 8:])


# -- copy-on-write ---------------------------------------------------------------------------------


@pytest.mark.parametrize("child_first", [True, False])
def test_shared_tail_page_is_copied_before_a_write(child_first):
    pool = make_pool()
    parent = committed_run(pool)
    child = Run(parent.seq.fork(), seed=9, kv=parent.kv.copy())
    snaps = {b: snapshot(pool, b) for b in (0, 1, 2)}
    first, second = (child, parent) if child_first else (parent, child)
    first.feed([50])
    first.seq.commit()
    # The shared open page 2 was copied to 3; page 2 is unchanged, held by the other one.
    assert first.seq.table.blocks == [0, 1, 3]
    assert pool.tokens(3) == (108, 109, 50)
    assert all(same(pool, b, s) for b, s in snaps.items())
    assert pool.ref_counts() == {0: 2, 1: 2, 2: 1, 3: 1}
    # The other one now holds page 2 alone: it writes in place.
    second.feed([60])
    second.seq.commit()
    assert second.seq.table.blocks == [0, 1, 2]
    assert pool.tokens(2) == (108, 109, 60) and pool.stats().used_pages == 4
    for r in (parent, child):
        r.check()
    assert not np.array_equal(parent.kv[:, :, :, 10], child.kv[:, :, :, 10])
    # Filling the pages seals them separately (different tokens).
    first.feed([51])
    second.feed([61])
    first.seq.commit()
    second.seq.commit()
    assert pool.is_sealed(2) and pool.is_sealed(3)
    assert pool.match_prefix(TOKS + [50, 51]) == [0, 1, 3]
    assert pool.match_prefix(TOKS + [60, 61]) == [0, 1, 2]
    for r in (parent, child):
        r.check()


def test_fork_at_a_page_boundary_needs_no_copy():
    pool = make_pool()
    parent = committed_run(pool, n=8)
    child = Run(parent.seq.fork(), seed=4, kv=parent.kv.copy())
    child.feed([1, 2])
    child.seq.commit()
    parent.feed([3])
    parent.seq.commit()
    assert child.seq.table.blocks == [0, 1, 2] and parent.seq.table.blocks == [0, 1, 3]
    assert pool.stats().used_pages == 4
    parent.check()
    child.check()
