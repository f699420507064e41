"""What an observer of the tiers is told (``kv_cache.watch_pages``, ``kv_cache.pages.events``):
a conversation's pages stored in memory with their parent chain and tokens, then on disk and in
the shared store, each tier by its medium; evictions removed; image pages with their keys."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kv_cache import watch_pages
from kv_cache.manager import CacheManager
from kv_cache.pages.events import MEDIUM_DISK, MEDIUM_RAM, MEDIUM_STORE, in_chain_order, \
    StoredPage
from kv_cache.pages.hashing import chain_hashes
from kv_cache.pages.spans import as_spans, page_extras
from kv_cache.tiers.disk.file_format import Geometry
from kv_cache.tiers.store import TieredStore, open_shared
from tests.kv_cache.test_manager import pool_for, store_for
from harness.redis_proc import running_redis
from harness.tiny_model import make_tiny_model

P = 4  # pool_for's page size


class Recorder:
    """Every call, in order: ("stored", medium, pages), ("removed", medium, hashes)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def stored(self, medium, pages):
        self.calls.append(("stored", medium, list(pages)))

    def removed(self, medium, hashes):
        self.calls.append(("removed", medium, list(hashes)))

    def pages(self, medium) -> list[StoredPage]:
        return [p for c in self.calls if c[0] == "stored" and c[1] == medium for p in c[2]]

    def gone(self, medium) -> list[bytes]:
        return [h for c in self.calls if c[0] == "removed" and c[1] == medium for h in c[2]]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3)


def a_turn(model, m, tokens, key, spans=()):
    seq, match = m.start(tokens, [], spans=spans)
    model(mx.array(tokens[match.tokens:])[None], cache=seq.prepare())
    seq.append_tokens(tokens[match.tokens:])
    m.save(key, seq)
    seq.close()


def assert_chain(pages, tokens, root, spans=()):
    """``pages`` are the full pages of ``tokens``, in order, each naming its parent."""
    hashes = chain_hashes(root, tokens, P, spans=spans)
    assert [p.hash for p in pages] == hashes
    assert [p.parent for p in pages] == [None] + hashes[:-1]
    assert [p.tokens for p in pages] == [tuple(tokens[i * P:(i + 1) * P])
                                         for i in range(len(hashes))]
    assert [p.extras for p in pages] == [page_extras(spans, i * P, P)
                                         for i in range(len(hashes))]


TURN1 = list(range(30, 41))  # 2 full pages and 3 tokens
TURN2 = TURN1 + list(range(60, 70))  # 5 full pages


def test_a_conversation_is_stored_in_memory_as_a_chain_and_the_next_turn_continues_it(model):
    m = CacheManager(pool_for(model))
    seen = Recorder()
    watch_pages(m, seen)
    assert seen.calls == []  # an empty cache: nothing held to tell of
    a_turn(model, m, TURN1, "t1")
    assert_chain(seen.pages(MEDIUM_RAM), TURN1, m.pool.root)
    first = seen.pages(MEDIUM_RAM)
    a_turn(model, m, TURN2, "t2")
    new = seen.pages(MEDIUM_RAM)[len(first):]
    assert new[0].parent == first[-1].hash  # the second turn's first new page continues it
    assert_chain(first + new, TURN2, m.pool.root)
    assert not seen.gone(MEDIUM_RAM)


def test_pages_evicted_from_memory_are_removed(model):
    m = CacheManager(pool_for(model))
    seen = Recorder()
    watch_pages(m, seen)
    a_turn(model, m, TURN2, "t")
    m.drop("t")
    assert m.pool.evict_all_cached() == 5
    assert sorted(seen.gone(MEDIUM_RAM)) == sorted(p.hash for p in seen.pages(MEDIUM_RAM))


def test_watching_later_tells_what_is_held_first(model):
    m = CacheManager(pool_for(model))
    a_turn(model, m, TURN2, "t")
    seen = Recorder()
    watch_pages(m, seen)
    assert_chain(seen.pages(MEDIUM_RAM), TURN2, m.pool.root)
    watch_pages(m, None)  # stop: the pages in memory go with the manager
    assert sorted(seen.gone(MEDIUM_RAM)) == sorted(p.hash for p in seen.pages(MEDIUM_RAM))
    n = len(seen.calls)
    a_turn(model, m, list(range(90, 99)), "after")
    assert len(seen.calls) == n  # not told any more


def test_disk_pages_are_told_apart_from_memory_and_their_removal_told(model, tmp_path):
    pool = pool_for(model)
    m = CacheManager(pool, store_for(pool, tmp_path))
    seen = Recorder()
    watch_pages(m, seen)
    a_turn(model, m, TURN2, "t")
    m.sync()
    assert_chain(seen.pages(MEDIUM_DISK), TURN2, pool.root)  # the tail file is not a page
    assert_chain(seen.pages(MEDIUM_RAM), TURN2, pool.root)
    m.drop("t")  # from memory and disk
    m.sync()
    assert sorted(seen.gone(MEDIUM_DISK)) == sorted(p.hash for p in seen.pages(MEDIUM_DISK))
    m.close()
    # a server started again over the same folder tells what the disk holds when watched
    pool = pool_for(model)
    m = CacheManager(pool, store_for(pool, tmp_path))
    a_turn(model, m, TURN1, "again")
    m.sync()
    seen = Recorder()
    watch_pages(m, seen)
    assert_chain(seen.pages(MEDIUM_DISK), TURN1, pool.root)
    m.close()


def test_image_pages_carry_their_keys(model, tmp_path):
    tokens = list(range(20, 29)) + [7] * 8 + list(range(40, 45))  # an image at 9..16
    spans = as_spans([(9, 8, "a" * 64)])
    pool = pool_for(model)
    m = CacheManager(pool, store_for(pool, tmp_path))
    seen = Recorder()
    watch_pages(m, seen)
    a_turn(model, m, tokens, "img", spans)
    m.sync()
    assert_chain(seen.pages(MEDIUM_RAM), tokens, pool.root, spans)
    assert_chain(seen.pages(MEDIUM_DISK), tokens, pool.root, spans)
    assert seen.pages(MEDIUM_RAM)[2].extras == (("a" * 64, -1, 8),)  # page 2 starts at 8
    m.close()


def test_pages_written_to_the_shared_store_are_told_as_its_medium(model, tmp_path):
    with running_redis(tmp_path / "redis") as redis:
        pool = pool_for(model)
        shared = open_shared(redis.url, Geometry(pool.fingerprint, P, pool.spec), "t")
        m = CacheManager(pool, TieredStore(store_for(pool, tmp_path / "disk"), shared))
        seen = Recorder()
        watch_pages(m, seen)
        a_turn(model, m, TURN2, "t")
        m.sync()
        shared.drain()
        assert_chain(seen.pages(MEDIUM_STORE), TURN2, pool.root)
        assert_chain(seen.pages(MEDIUM_DISK), TURN2, pool.root)
        m.close()


def test_chain_order_puts_parents_first():
    a, b, c = (StoredPage(bytes([i]), None if i == 1 else bytes([i - 1]), ()) for i in (1, 2, 3))
    assert in_chain_order([c, b, a]) == [a, b, c]
    assert in_chain_order([c]) == [c]  # a parent not among them: as it is
