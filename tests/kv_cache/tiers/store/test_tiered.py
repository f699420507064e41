"""The shared store under the disk tier, with a real redis-server: two managers (two servers,
each its own disk folder) share one store; what comes down is exact, and a bad value is a miss."""

from __future__ import annotations

import gc
import time

import mlx.core as mx
import pytest

from kv_cache.manager import CacheManager
from kv_cache.tiers.disk.file_format import Geometry
from kv_cache.tiers.disk.store import DiskStore
from kv_cache.tiers.store import TieredStore, open_shared
from kv_cache.tiers.store import values as val
from tests.kv_cache.test_manager import pool_for, reference
from harness.redis_proc import running_redis
from harness.tiny_model import make_tiny_model

NS = "t"


def run(model, seq, tokens):
    logits = model(mx.array(tokens)[None], cache=seq.prepare())[0, -1]
    seq.append_tokens(tokens)
    return logits


@pytest.fixture
def redis_server(tmp_path):
    with running_redis(tmp_path / "redis") as proc:
        yield proc


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3)


def manager(model, root, url, namespace=NS, **kw):
    pool = pool_for(model)
    disk = DiskStore(root, fingerprint=pool.fingerprint, spec=pool.spec,
                     page_size=pool.page_size, max_bytes=1 << 26)
    shared = open_shared(url, Geometry(pool.fingerprint, pool.page_size, pool.spec), namespace,
                         **kw)
    return CacheManager(pool, TieredStore(disk, shared))


def finish(m):
    m.sync()
    m.store.shared.drain()


def a_turn(model, m, tokens, key):
    seq, match = m.start(tokens, [])
    run(model, seq, tokens[match.tokens:])
    m.save(key, seq)
    seq.close()
    finish(m)


TOKENS = list(range(30, 57))  # 6 pages of 4 and 3 tokens


def test_an_entry_saved_by_one_server_restores_exactly_on_another(model, tmp_path, redis_server):
    a = manager(model, tmp_path / "a", redis_server.url)
    a_turn(model, a, TOKENS, "m1")
    s = a.store.shared.stats()
    assert s.entries_written == 1 and s.pages_written == 7  # 6 pages and the open tail
    names = redis_server.client().keys("*")
    assert not any(b"m1" in n for n in names)  # only the id's hash is a key
    b = manager(model, tmp_path / "b", redis_server.url)
    longer = TOKENS + [7, 8]
    seq, match = b.start(longer, ["m2", "m1"])
    assert (match.tokens, match.source) == (len(TOKENS), "disk:m1")
    assert mx.allclose(run(model, seq, longer[len(TOKENS):]), reference(model, longer),
                       atol=1e-4).item()
    b.save("m2", seq)
    seq.close()
    finish(b)
    assert b.store.shared.stats().pages_read == 7
    assert b.store.disk.get("m2") is not None  # copied into the local disk with the turn
    assert b.store.shared.stats().pages_written == 2  # only its new full page and tail
    a.close()
    b.close()


def test_an_entry_in_both_tiers_and_shed_from_memory_leaves_no_bytes_behind(model, tmp_path,
                                                                              redis_server):
    """Each writer (disk, shared store) lets go of its last entry's pages once written: kept
    until the next write, they outlived the entry's eviction (tests/kv_cache/test_saving.py)."""
    m = manager(model, tmp_path / "a", redis_server.url)
    tokens = [5 + i % 200 for i in range(1000)]
    gc.collect()
    base = mx.get_active_memory()
    a_turn(model, m, tokens, "k")
    entry_bytes = m.pool.stats().used_bytes
    assert entry_bytes > 100_000 and m.store.shared.stats().entries_written == 1
    m.shed()
    gc.collect()
    assert m.pool.stats().used_bytes == 0
    assert mx.get_active_memory() - base < entry_bytes // 4
    m.close()


def test_a_prompt_without_ids_finds_its_pages_by_content(model, tmp_path, redis_server):
    a = manager(model, tmp_path / "a", redis_server.url)
    a_turn(model, a, TOKENS, "x")
    b = manager(model, tmp_path / "b", redis_server.url)
    seq, match = b.start(TOKENS + [9], [])
    assert (match.tokens, match.source) == (24, "disk-prefix")  # its 6 full pages
    assert mx.allclose(run(model, seq, (TOKENS + [9])[24:]), reference(model, TOKENS + [9]),
                       atol=1e-4).item()
    seq.close()
    a.close()
    b.close()


def _page_names(client):
    return sorted(n for n in client.keys(f"{NS}:*:page:*"))


@pytest.mark.parametrize("damage", ["corrupt", "other-model", "truncated"])
def test_a_bad_value_is_a_counted_deleted_miss_and_the_answer_stays_exact(
        model, tmp_path, redis_server, damage):
    a = manager(model, tmp_path / "a", redis_server.url)
    a_turn(model, a, TOKENS, "m1")
    client = redis_server.client()
    pool = a.pool
    hashes = a.store.disk.get("m1").page_hashes
    name = a.store.shared.keys.page(hashes[2])  # the third page
    value = client.get(name)
    if damage == "corrupt":
        bad = value[:-9] + bytes([value[-9] ^ 1]) + value[-8:]
    elif damage == "truncated":
        bad = value[: len(value) // 2]
    else:  # a value made for another model, under this key
        other = Geometry("another-model", pool.page_size, pool.spec)
        bad = val.join(val.wrap(other, val.PAGE, hashes[2], [value[val.HEADER.size:]]))
    client.set(name, bad)
    b = manager(model, tmp_path / "b", redis_server.url)
    seq, match = b.start(TOKENS + [1], ["m1"])
    assert match.tokens == 8  # the two pages before the bad one
    assert mx.allclose(run(model, seq, (TOKENS + [1])[8:]), reference(model, TOKENS + [1]),
                       atol=1e-4).item()
    seq.close()
    s = b.store.shared.stats()
    assert s.bad_values == 1 and client.get(name) is None
    a.close()
    b.close()


def test_a_tenant_sees_only_its_namespace(model, tmp_path, redis_server):
    a = manager(model, tmp_path / "a", redis_server.url, namespace="team1")
    a_turn(model, a, TOKENS, "m1")
    b = manager(model, tmp_path / "b", redis_server.url, namespace="team2")
    seq, match = b.start(TOKENS + [1], ["m1"])
    assert match.tokens == 0
    seq.close()
    a.close()
    b.close()


def test_a_store_that_is_down_is_a_miss_and_the_breaker_stops_asking(model, tmp_path,
                                                                      redis_server):
    a = manager(model, tmp_path / "a", redis_server.url)
    a_turn(model, a, TOKENS, "m1")
    b = manager(model, tmp_path / "b", redis_server.url, cool_down=0.3)
    redis_server.stop()
    for i in range(4):
        seq, match = b.start(TOKENS + [i], ["m1"])
        assert match.tokens == 0  # answered from the local tiers (nothing there)
        assert mx.allclose(run(model, seq, TOKENS + [i]), reference(model, TOKENS + [i]),
                           atol=1e-4).item()
        seq.close()
    s = b.store.shared.stats()
    assert s.breaker == "open" and s.errors == 3 and s.breaker_opens == 1
    redis_server.start()  # back, empty
    a_turn(model, a, TOKENS + [5], "m3")  # every page written again (the store lost them)
    time.sleep(0.35)  # the cool-down
    seq, match = b.start(TOKENS + [5, 6], ["m3"])
    assert match.tokens == len(TOKENS) + 1 and b.store.shared.stats().breaker == "closed"
    seq.close()
    a.close()
    b.close()


def test_wrong_password_is_a_warning_not_an_error(model, tmp_path, caplog):
    from harness.redis_proc import RedisProc

    proc = RedisProc(tmp_path / "r", "--requirepass", "right").start()
    try:
        url = f"redis://:wrong@127.0.0.1:{proc.port}/0"
        with caplog.at_level("WARNING", logger="kv_cache.store"):
            m = manager(model, tmp_path / "a", url)
        assert "authentication failed" in caplog.text and "wrong" not in caplog.text
        a_turn(model, m, TOKENS, "m1")  # answers; the store is only not used
        m.close()
    finally:
        proc.stop()


def test_an_entry_being_written_still_counts_as_queued(model, tmp_path, redis_server,
                                                       monkeypatch):
    """``queued`` (what a client waits on before it relies on the store) counts the write in
    progress too, not only the ones waiting behind it."""
    import threading

    m = manager(model, tmp_path / "a", redis_server.url)
    shared = m.store.shared
    started, release = threading.Event(), threading.Event()
    write = shared.write

    def slow_write(job):
        started.set()
        release.wait(timeout=30)
        return write(job)

    monkeypatch.setattr(shared, "write", slow_write)
    seq, _ = m.start(TOKENS, [])
    run(model, seq, TOKENS)
    m.save("slow", seq)
    seq.close()
    m.sync()  # the disk's write done: the entry is on the store's queue
    assert started.wait(timeout=30)
    assert shared.stats().queued == 1  # taken off the queue, not written yet
    release.set()
    shared.drain()
    assert shared.stats().queued == 0 and shared.stats().entries_written == 1
    m.close()


def test_another_image_never_comes_down_past_its_start_and_the_same_one_does(model, tmp_path,
                                                                             redis_server):
    from kv_cache.pages.spans import as_spans

    tokens = TOKENS[:9] + [7] * 8 + TOKENS[17:]  # an image's tokens at 9..16
    same, other = as_spans([(9, 8, "a" * 64)]), as_spans([(9, 8, "b" * 64)])
    a = manager(model, tmp_path / "a", redis_server.url)
    seq, _ = a.start(tokens, [], spans=same)
    run(model, seq, tokens)
    a.save("m1", seq)
    seq.close()
    finish(a)
    longer = tokens + [7, 8]
    for n, spans in enumerate([other, same, other]):  # each server has its own, empty disk
        b = manager(model, tmp_path / f"b{n}", redis_server.url)
        by_id = b.start(longer, ["m1"], spans=spans)
        by_id[0].close()
        b.close()
        b = manager(model, tmp_path / f"c{n}", redis_server.url)
        by_content = b.start(longer, [], spans=spans)  # no ids: the store's pages by hash
        by_content[0].close()
        if spans is same:
            assert by_id[1].tokens == len(tokens) and by_id[1].source == "disk:m1"
            assert by_content[1].tokens == len(tokens) // 4 * 4
        else:
            assert by_id[1].tokens <= 9 and by_content[1].tokens <= 9
        b.close()
    a.close()
