"""Making room (kv_cache/room.py): the pool never calls up. A caller that runs out of pages asks
the manager, which drops resident sequences, then entries, least recently used first, and the
caller tries again; a commit that ran out part way goes on where it stopped."""

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.errors import OutOfBlocksError
from kv_cache.manager import CacheManager
from kv_cache.model.spec_reader import spec_of_model
from kv_cache.pages.holders import ENTRY, RESIDENT, SEQUENCE
from kv_cache.pages.pool import PagePool
from harness.tiny_families import make_tiny_family_model
from harness.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3)


def small_pool(model, pages: int) -> PagePool:
    a = model.args
    head_dim = a.hidden_size // a.num_attention_heads
    page_bytes = a.num_hidden_layers * 2 * a.num_key_value_heads * 4 * head_dim * 4  # float32
    return PagePool(a.num_hidden_layers, a.num_key_value_heads, head_dim, page_size=4,
                    dtype=mx.float32, max_bytes=page_bytes * pages, fingerprint="tiny")


def run(model, seq, tokens):
    model(mx.array(tokens)[None], cache=seq.prepare())
    seq.append_tokens(tokens)


def turn(m: CacheManager, model, tokens, key: str | None = None):
    seq, _ = m.start(tokens, [])
    run(model, seq, tokens)
    if key is not None:
        m.save(key, seq)
    return seq


def pages(seq) -> list[int]:
    return [b for t in seq.tables for b in t.blocks if b is not None]


def test_room_comes_from_resident_sequences_then_the_oldest_entries(model):
    m = CacheManager(small_pool(model, 8))
    a = turn(m, model, list(range(100, 108)), "a")  # 2 pages
    m.keep(a)  # resident too
    turn(m, model, list(range(200, 208)), "b").close()  # 2 more
    pool = m.pool
    assert pool.holders.held_by(RESIDENT) == Counter(pages(a))
    assert pool.holders.held_by(ENTRY) == Counter(pages(a) + m.get("b").blocks)
    assert pool.holders.held_by(SEQUENCE) == {}
    assert not m.make_room(4)  # 4 pages are free: nothing to drop
    assert m.make_room(6)  # the resident sequence, then "a" (older than "b")
    assert a.closed and "a" not in m and "b" in m and m.stats.entries_dropped == 1
    assert pool.can_allocate(6)
    assert not m.make_room(6)


def test_with_room_tries_again_once_room_is_made_and_raises_when_none_can_be(model):
    m = CacheManager(small_pool(model, 2))
    turn(m, model, list(range(100, 108)), "old").close()  # holds both pages
    seq = turn(m, model, list(range(300, 308)))
    with pytest.raises(OutOfBlocksError) as e:
        seq.commit()  # the pool does not drop the entry itself
    assert (e.value.pages, e.value.group) == (2, 0) and "old" in m
    m.with_room(seq.commit)
    assert "old" not in m and m.stats.entries_dropped == 1 and seq.committed == 8
    other = turn(m, model, list(range(400, 408)))
    with pytest.raises(OutOfBlocksError):
        m.with_room(other.commit)  # only running sequences hold pages: the caller's to give up
    assert m.stats.entries_dropped == 1 and not seq.closed
    seq.close()
    other.close()


def test_a_commit_that_runs_out_in_its_second_group_goes_on_where_it_stopped():
    """gemma3: a sliding-window group, then a full-attention one. The window's pages fit, the
    full group's do not until the old entry goes; the commit tried again writes the full group
    only, and every page holds what a commit with room to spare writes."""
    lm = make_tiny_family_model("gemma3_text")
    spec = spec_of_model(lm, "gemma3_text")
    rng = np.random.default_rng(1)
    old, new = ([int(t) for t in rng.integers(3, 300, 40)] for _ in range(2))

    def manager(pages: int) -> CacheManager:
        return CacheManager(PagePool(spec=spec, page_size=8, fingerprint="m",
                                     max_bytes=spec.groups[0].page_bytes(8) * pages))

    ref = turn(manager(64), lm, new)
    ref.commit()
    m = manager(10)
    turn(m, lm, old, "old").close()  # 2 window pages + 5 full ones: 3 pages left
    seq = turn(m, lm, new)
    with pytest.raises(OutOfBlocksError) as e:
        seq.commit()
    assert (e.value.pages, e.value.group) == (5, 1)  # the window's 2 pages were written
    m.with_room(seq.commit)
    assert m.stats.entries_dropped == 1 and seq.committed == 40
    for got, want in zip(seq.tables, ref.tables):
        assert [b is None for b in got.blocks] == [b is None for b in want.blocks]
        have = [b for b in got.blocks if b is not None]
        assert m.pool.all_sealed(have)
        n = len(have) * 8
        np.testing.assert_array_equal(np.array(m.pool.gather(have, n)),
                                      np.array(ref.pool.gather(
                                          [b for b in want.blocks if b is not None], n)))
    assert m.pool.holders.held_by(SEQUENCE) == Counter(pages(seq))
    seq.close()
    ref.close()
