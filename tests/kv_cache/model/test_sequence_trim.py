"""Trimming a sequence, by ``PagedSequence.trim`` or by mlx-lm's ``trim_prompt_cache`` on its
layers: tokens and pages dropped, and the next commit copies a partial sealed page.
"""

import pytest
from mlx_lm.models.cache import trim_prompt_cache

from tests.kv_cache.model.sequence_helpers import (TOKS, Run, committed_run, make_pool, same,
                                                   snapshot)


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
