"""PagedSequence with a fake forward pass: starting from cached pages, fork, working buffers,
memory reports, close.

Writing pages (commit, seal, copy-on-write) is in ``test_page_writes.py``, trims in
``test_sequence_trim.py``.
"""

import pytest

from kv_cache.model.sequence import PagedSequence

from tests.kv_cache.model.sequence_helpers import (BUF_BYTES, D, H, L, PAGE_BYTES, TOKS, Run,
                                                   committed_run, make_pool, same, snapshot)


# -- starting from cached pages --------------------------------------------------------------------


def test_new_sequence_from_a_cached_prefix_gathers_it_on_first_use():
    pool = make_pool()
    a = committed_run(pool)
    a.seq.close()
    blocks = pool.match_prefix(TOKS + [7])
    assert blocks == [0, 1] and pool.ref_counts() == {0: 0, 1: 0}
    seq = PagedSequence(pool, TOKS[:8], blocks)
    assert pool.ref_counts() == {0: 1, 1: 1} and seq.offset == 8 and seq.committed == 8
    assert all(layer.keys is None for layer in seq.layers)
    b = Run(seq, seed=5, kv=a.kv[:, :, :, :8])
    b.feed([7, 8])
    b.check()  # update_and_fetch returned the gathered 8 positions, then the new 2
    assert b.fetched[0].shape[2] == 10
    seq.commit()
    assert seq.table.blocks == [0, 1, 3]  # a's open page 2 was freed at close: 3 is fresh
    b.check()


def test_new_sequence_from_a_partial_tail_copies_it_first():
    pool = make_pool()
    a = committed_run(pool)
    blocks = a.seq.prefix_blocks(6)
    assert blocks == [0, 1]
    s0, s1 = snapshot(pool, 0), snapshot(pool, 1)
    b = Run(PagedSequence(pool, TOKS[:6], blocks), seed=3, kv=a.kv[:, :, :, :6])
    assert pool.ref_counts() == {0: 2, 1: 2, 2: 1}
    b.feed([55])
    b.seq.commit()
    assert b.seq.table.blocks == [0, 3]  # sealed page 1 (6 of 10 in view) copied to 3
    assert pool.tokens(3) == (104, 105, 55) and not pool.is_sealed(3)
    assert same(pool, 0, s0) and same(pool, 1, s1)
    assert pool.ref_counts() == {0: 2, 1: 1, 2: 1, 3: 1}
    a.check()
    b.check()


def test_constructor_holds_its_blocks_and_checks_them():
    pool = make_pool()
    a = committed_run(pool)
    with pytest.raises(ValueError):
        PagedSequence(pool, TOKS[:4], [0, 1])  # second block would be empty
    assert pool.ref_counts() == {0: 1, 1: 1, 2: 1}
    seq = PagedSequence(pool, TOKS[:9], [0, 1, 2])
    assert pool.ref_counts() == {0: 2, 1: 2, 2: 2}
    seq.close()
    a.check()


def test_prefix_blocks():
    pool = make_pool()
    r = committed_run(pool)
    assert r.seq.prefix_blocks(4) == [0]
    assert r.seq.prefix_blocks(5) == [0, 1]
    assert r.seq.prefix_blocks(10) == [0, 1, 2]
    assert r.seq.prefix_blocks(0) == []
    r.feed([1])
    with pytest.raises(ValueError):
        r.seq.prefix_blocks(11)  # not committed yet


# -- fork ------------------------------------------------------------------------------------------


def test_fork_copies_metadata_only():
    pool = make_pool()
    r = committed_run(pool)
    used = pool.stats().used_pages
    child = r.seq.fork()
    assert child.table.blocks == r.seq.table.blocks == [0, 1, 2]
    assert child.table is not r.seq.table
    assert pool.ref_counts() == {0: 2, 1: 2, 2: 2}
    assert pool.stats().used_pages == used
    assert child.tokens == TOKS and child.tokens is not r.seq.tokens
    assert (child.offset, child.committed) == (10, 10)
    assert all(layer.keys is None for layer in child.layers)  # no data copied
    assert PagedSequence.branch is PagedSequence.fork
    r.check()


def test_fork_commits_the_parent_first():
    pool = make_pool()
    r = Run(PagedSequence(pool))
    r.feed(TOKS[:6])
    child = r.seq.fork()
    assert r.seq.committed == 6 and child.committed == 6
    assert pool.ref_counts() == {0: 2, 1: 2}
    r.check()


def test_forks_of_forks_and_close_restore_ref_counts():
    pool = make_pool()
    r = committed_run(pool)
    kids = [r.seq.fork() for _ in range(3)]
    grandkid = kids[0].fork()
    assert pool.ref_counts() == {0: 5, 1: 5, 2: 5}
    for k in kids:
        k.close()
    assert pool.ref_counts() == {0: 2, 1: 2, 2: 2}
    grandkid.close()
    assert pool.ref_counts() == {0: 1, 1: 1, 2: 1}
    r.check()


# -- buffers, reports, close -----------------------------------------------------------------------


def test_drop_buffers_commits_and_the_next_pass_gathers():
    pool = make_pool()
    r = Run(PagedSequence(pool))
    r.feed(TOKS[:7])
    r.seq.drop_buffers()
    assert r.seq.committed == 7 and all(layer.keys is None for layer in r.seq.layers)
    assert r.seq.memory_report().working_bytes == 0
    assert r.seq.offset == 7
    r.feed([5])
    assert r.fetched[0].shape[2] == 8
    r.check()


def test_memory_report_exact_numbers():
    pool = make_pool()
    parent = committed_run(pool)
    rep = parent.seq.memory_report()
    assert (rep.length, rep.own_bytes, rep.shared_bytes, rep.divergence_point) == (
        10, 3 * PAGE_BYTES, 0, 0)
    assert rep.working_bytes == BUF_BYTES and rep.total_bytes == 3 * PAGE_BYTES
    child = Run(parent.seq.fork(), seed=2, kv=parent.kv.copy())
    rep = parent.seq.memory_report()
    assert (rep.length, rep.own_bytes, rep.shared_bytes, rep.divergence_point) == (
        10, 0, 3 * PAGE_BYTES, 10)
    crep = child.seq.memory_report()
    assert (crep.own_bytes, crep.shared_bytes, crep.working_bytes) == (0, 3 * PAGE_BYTES, 0)
    child.feed([1])
    child.seq.commit()
    crep = child.seq.memory_report()
    assert (crep.length, crep.own_bytes, crep.shared_bytes, crep.divergence_point) == (
        11, PAGE_BYTES, 2 * PAGE_BYTES, 8)
    # Gathered 10 positions into a buffer with room up to the next 256-step: 256 positions.
    assert crep.working_bytes == L * 2 * (H * 256 * D * 4)


    rep = parent.seq.memory_report()
    assert (rep.own_bytes, rep.shared_bytes, rep.divergence_point) == (
        PAGE_BYTES, 2 * PAGE_BYTES, 8)


def test_close_releases_everything():
    pool = make_pool()
    r = committed_run(pool)
    child = r.seq.fork()
    r.seq.close()
    assert pool.ref_counts() == {0: 1, 1: 1, 2: 1}
    assert r.seq.closed and (len(r.seq), r.seq.offset, r.seq.committed) == (0, 0, 0)
    assert r.seq.table.blocks == [] and r.seq.memory_report().total_bytes == 0
    r.seq.close()  # idempotent
    assert pool.ref_counts() == {0: 1, 1: 1, 2: 1}
    with child:
        pass
    assert child.closed
    assert pool.ref_counts() == {0: 0, 1: 0}  # sealed pages cached, the open one freed
    st = pool.stats()
    assert (st.used_pages, st.held_pages, st.cached_pages) == (2, 0, 2)
    assert pool.match_prefix(TOKS) == [0, 1]
    assert pool.evict_all_cached() == 2
    assert pool.allocator.num_free == pool.capacity and pool.storage.arrays == {}
