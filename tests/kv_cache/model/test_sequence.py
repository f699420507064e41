"""PagedSequence with a fake forward pass: commit, seal, copy-on-write, fork, trim, reports,
close."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import trim_prompt_cache

from kv_cache.errors import OutOfBlocksError
from kv_cache.pages.hashing import page_hash
from kv_cache.pages.pool import PagePool
from kv_cache.model.sequence import PagedSequence

L, H, D, P = 2, 2, 3, 4
PAGE_BYTES = L * 2 * H * P * D * 4  # float32: 384
BUF_BYTES = L * 2 * (H * 256 * D * 4)  # one 256-step working buffer per layer, keys and values


def make_pool(pages: int = 64, policy: str = "lru") -> PagePool:
    return PagePool(L, H, D, page_size=P, dtype=mx.float32, max_bytes=PAGE_BYTES * pages,
                    policy=policy)


class Run:
    """A sequence fed by a fake forward pass; keeps the keys/values it fed, as
    ``[layers, 2, kv_heads, tokens, head_dim]`` (the pages' layout)."""

    def __init__(self, seq: PagedSequence, seed: int = 0, kv: np.ndarray | None = None):
        self.seq = seq
        self.rng = np.random.default_rng(seed)
        self.kv = np.zeros((L, 2, H, 0, D), np.float32) if kv is None else kv
        self.fetched: list[np.ndarray] = []  # what update_and_fetch returned, per layer

    def feed(self, ids) -> None:
        n = len(ids)
        new = self.rng.standard_normal((L, 2, H, n, D)).astype(np.float32)
        self.fetched = []
        for i, layer in enumerate(self.seq.prepare()):
            k, v = layer.update_and_fetch(mx.array(new[i, 0][None]), mx.array(new[i, 1][None]))
            self.fetched.append(np.stack([np.array(k[0]), np.array(v[0])]))
        self.seq.append_tokens(ids)
        self.kv = np.concatenate([self.kv, new], axis=3)

    def trim(self, n: int) -> None:
        self.kv = self.kv[:, :, :, : self.kv.shape[3] - n]
        self.fetched = []

    def check(self) -> None:
        """The pages hold what was fed, and the last forward pass saw all of it."""
        seq, pool = self.seq, self.seq.pool
        c = seq.committed
        assert seq.table.num_tokens == c
        if c:
            got = np.array(pool.gather(seq.table.blocks, c))
            np.testing.assert_array_equal(got, self.kv[:, :, :, :c])
            toks = sum((pool.tokens(b) for b in seq.table.blocks), ())[:c]
            assert list(toks) == seq.tokens[:c]
        for i, f in enumerate(self.fetched):
            np.testing.assert_array_equal(f, self.kv[i, :, :, : f.shape[2]])


def snapshot(pool, b):
    return pool.tokens(b), np.array(pool.data(b))


def same(pool, b, snap) -> bool:
    return pool.tokens(b) == snap[0] and np.array_equal(np.array(pool.data(b)), snap[1])


TOKS = list(range(100, 110))  # 10 tokens: pages of 4, 4 and 2


def committed_run(pool, n=10, seed=0) -> Run:
    r = Run(PagedSequence(pool), seed)
    r.feed(TOKS[:n])
    r.seq.commit()
    return r


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


# -- fork and copy-on-write ------------------------------------------------------------------------


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


# -- trim ------------------------------------------------------------------------------------------


def test_trim_drops_tokens_and_pages_then_copies_the_partial_sealed_page():
    pool = make_pool()
    r = committed_run(pool)
    s1 = snapshot(pool, 1)
    assert r.seq.trim(3) == 3
    r.trim(3)
    seq = r.seq
    assert (len(seq), seq.offset, seq.committed, seq.table.num_tokens) == (7, 7, 7, 7)
    assert seq.tokens == TOKS[:7]
    assert seq.table.blocks == [0, 1]
    assert not pool.allocator.is_allocated(2)  # the open page was freed
    assert pool.ref_counts() == {0: 1, 1: 1}
    r.feed([70])
    seq.commit()
    # Page 1 is sealed with 4 tokens, 3 in view: the commit copies them to a new page.
    assert seq.table.blocks == [0, 3]
    assert pool.tokens(3) == (104, 105, 106, 70) and pool.is_sealed(3)
    assert same(pool, 1, s1)
    assert pool.ref_counts() == {0: 1, 1: 0, 3: 1}  # page 1 stays cached
    assert pool.match_prefix(TOKS[:8]) == [0, 1]
    assert pool.match_prefix(TOKS[:7] + [70]) == [0, 3]
    r.check()


def test_trim_into_an_open_page_held_alone_still_copies():
    pool = make_pool()
    r = committed_run(pool)
    r.seq.trim(1)
    r.trim(1)
    assert r.seq.table.blocks == [0, 1, 2] and pool.tokens(2) == (108, 109)
    r.feed([99])
    r.seq.commit()
    assert r.seq.table.blocks == [0, 1, 3] and pool.tokens(3) == (108, 99)
    assert not pool.allocator.is_allocated(2)
    r.check()


def test_trim_clamps_and_trim_to_zero_releases_everything():
    pool = make_pool()
    r = committed_run(pool)
    assert r.seq.trim(100) == 10
    assert (len(r.seq), r.seq.offset, r.seq.committed, r.seq.table.blocks) == (0, 0, 0, [])
    assert pool.ref_counts() == {0: 0, 1: 0}  # sealed pages cached, the open one freed
    r.kv = r.kv[:, :, :, :0]
    r.feed([1, 2])
    r.seq.commit()
    assert r.seq.table.blocks == [3]  # fresh ids go before the freed 2
    r.check()


def test_trim_of_uncommitted_positions_leaves_the_pages():
    pool = make_pool()
    r = committed_run(pool, n=6)
    r.feed(TOKS[6:9])
    assert r.seq.trim(2) == 2
    r.trim(2)
    assert (len(r.seq), r.seq.committed, r.seq.table.blocks) == (7, 6, [0, 1])
    r.seq.commit()
    assert pool.tokens(1) == tuple(TOKS[4:7]) and r.seq.table.blocks == [0, 1]
    r.check()


def test_trim_of_a_fork_leaves_the_parent_alone():
    pool = make_pool()
    parent = committed_run(pool)
    child = Run(parent.seq.fork(), seed=8, kv=parent.kv.copy())
    child.seq.trim(5)
    child.trim(5)
    assert child.seq.table.blocks == [0, 1]
    assert pool.ref_counts() == {0: 2, 1: 2, 2: 1}
    child.feed([1, 2, 3])
    child.seq.commit()
    assert child.seq.table.blocks == [0, 3]  # 1 token of page 1 copied, then filled
    assert pool.tokens(3) == (104, 1, 2, 3) and pool.is_sealed(3)
    parent.check()
    child.check()


@pytest.mark.parametrize("drop_buffers", [False, True])
def test_mlx_lm_trim_prompt_cache_on_the_layers(drop_buffers):
    """Regression: trimming the layers alone (mlx-lm's trim_prompt_cache) and running the next
    forward pass took the trimmed token ids for the new positions."""
    pool = make_pool()
    r = committed_run(pool)
    if drop_buffers:
        r.seq.drop_buffers()
    assert trim_prompt_cache(r.seq.layers, 3) == 3
    r.trim(3)
    assert r.seq.offset == 7
    r.feed([80, 81])
    assert r.seq.tokens == TOKS[:7] + [80, 81]
    r.seq.commit()
    assert r.seq.table.blocks == [0, 3, 4]
    assert pool.tokens(3) == (104, 105, 106, 80) and pool.tokens(4) == (81,)
    r.check()


def test_trim_prompt_cache_then_commit():
    pool = make_pool()
    r = committed_run(pool)
    trim_prompt_cache(r.seq.layers, 6)
    r.seq.commit()
    assert (len(r.seq), r.seq.committed, r.seq.table.blocks) == (4, 4, [0])
    r.trim(6)
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
