"""The shared page store through real servers: two servers (each its own disk folder) on one
real redis-server. A conversation goes on from the store on the other server, a document is
computed once, a bad value is a miss, an evicting or vanished store costs reuse, never answers.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import pytest

from kv_cache.tiers.disk.file_format import Geometry
from kv_cache.tiers.store import values as val
from mlx_kvserver.config import ServerConfig
from harness.redis_proc import RedisProc, running_redis
from harness.server_utils import running_server
from tests.test_persistence import ask, run_turns

TURNS = ["Tell me about the sea.", "And the mountains?", "Which is older?"]
DOC = " ".join(f"Line {i}: the harbour of town {i % 7} keeps {i * 3} boats." for i in range(40))


@pytest.fixture
def redis_server(tmp_path):
    with running_redis(tmp_path / "redis") as proc:
        yield proc


@pytest.fixture(scope="module")
def tiny_lm_again(tiny_model_dir):
    """The tiny model loaded a second time: the second server's own copy."""
    from mlx_kvserver.models.loading import resolve_and_load

    return resolve_and_load(str(tiny_model_dir))


def config(folder: Path, url: str | None, **kw) -> ServerConfig:
    return ServerConfig(max_tokens=8, page_size=8, kv_cache_dir=folder, kv_store=url, **kw)


def stats(url: str, model: str) -> dict:
    return httpx.get(f"{url}/kv_cache/stats").json()["models"][model]


def settled(url: str, model: str) -> dict:
    """The stats once the server's store writes are done (they run after each answer)."""
    for _ in range(200):
        s = stats(url, model)
        if s["store"]["queued"] == 0:
            return s
        time.sleep(0.02)
    return s


def no_ids(messages):
    return [{k: v for k, v in m.items() if k != "message_id"} for m in messages]


def test_a_conversation_goes_on_from_the_store_on_another_server(
        tiny_lm, tiny_lm_again, tmp_path, redis_server):
    name = tiny_lm.name
    with running_server([tiny_lm], config(tmp_path / "a", redis_server.url)) as a:
        history = run_turns(a, name, "c", TURNS[:2])
        before = ask(a, name, history[:-1])[2].prompt_tokens  # the last prompt, again
        settled(a, name)
        history.append({"role": "user", "content": TURNS[2], "message_id": "c-u2"})
        with running_server([tiny_lm_again], config(tmp_path / "b", redis_server.url)) as b:
            on_b, _, usage = ask(b, name, history)
            cold = ask(b, name, history, use_cache=False)[0]
            # a client that sends no ids: found by the prompt's own page hashes
            plain = no_ids(history[:-1]) + [{"role": "user", "content": "Now the rivers?"}]
            without, _, plain_usage = ask(b, name, plain)
            s = settled(b, name)["store"]
        on_a = ask(a, name, history)[0]
        plain_cold = ask(a, name, plain, use_cache=False)[0]
    assert on_b == on_a == cold
    assert usage.prompt_tokens_details.cached_tokens >= before
    assert without == plain_cold and plain_usage.prompt_tokens_details.cached_tokens >= 8
    assert s["hits"] >= 2 and s["pages_read"] > 0 and s["errors"] == s["bad_values"] == 0


def test_two_servers_compute_a_shared_document_once(tiny_lm, tiny_lm_again, tmp_path,
                                                    redis_server):
    name, doc = tiny_lm.name, {"role": "system", "content": DOC}
    first, second = ([doc, {"role": "user", "content": q}]
                     for q in ("How many boats in town 3?", "And town 5?"))
    with running_server([tiny_lm], config(tmp_path / "a", redis_server.url)) as a:
        ask(a, name, first)
        settled(a, name)
    with running_server([tiny_lm_again], config(tmp_path / "b", redis_server.url)) as b:
        _, _, usage = ask(b, name, second)
        s = settled(b, name)["store"]
    tok = tiny_lm.tokenizer
    a_ids, b_ids = (tok.encode(tok.render(m, add_generation_prompt=True)) for m in (first, second))
    common = next(i for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x != y)
    doc_pages = common // 8
    assert doc_pages > 100 and usage.prompt_tokens_details.cached_tokens == 8 * doc_pages
    assert s["pages_read"] == doc_pages  # computed once, on a; b computed only its own pages:
    assert s["pages_written"] <= (len(b_ids) - 8 * doc_pages) // 8 + 4


def damage(client, name: bytes, kind: str, page: bytes) -> bytes:
    value = client.get(name)
    if kind == "corrupt":
        bad = value[:-9] + bytes([value[-9] ^ 1]) + value[-8:]
    elif kind == "truncated":
        bad = value[: len(value) - 100]
    else:  # another model's value (or another format's: the same check) under this key
        from kv_cache.layout.spec import CacheSpec
        import mlx.core as mx

        other = Geometry("other-model", 8, CacheSpec.plain(2, 2, 16, mx.float32))
        bad = val.join(val.wrap(other, val.PAGE, page, [value[val.HEADER.size:]]))
    client.set(name, bad)
    return bad


def test_a_bad_value_is_a_counted_deleted_miss_and_the_answer_stays_exact(
        tiny_lm, tiny_lm_again, tmp_path, redis_server):
    name = tiny_lm.name
    with running_server([tiny_lm], config(tmp_path / "a", redis_server.url)) as a:
        history = run_turns(a, name, "d", TURNS[:2])
        settled(a, name)
    client = redis_server.client()
    prefix = client.keys("kv:*:entry:*")[0].split(b":entry:")[0]
    for i, kind in enumerate(["corrupt", "truncated", "other-model"]):
        msgs = history + [{"role": "user", "content": f"Question {i}?", "message_id": f"q{i}"}]
        entry = val.check_entry(_geo(tiny_lm), history[-1]["message_id"],
                                client.get(prefix + b":entry:" + val.entry_id(
                                    history[-1]["message_id"]).hex().encode()))[0]
        page = entry.page_hashes[2 + i]
        key = prefix + b":page:" + page.hex().encode()
        bad = damage(client, key, kind, page)
        with running_server([tiny_lm_again], config(tmp_path / f"b{i}", redis_server.url)) as b:
            got, _, usage = ask(b, name, msgs)
            cold = ask(b, name, msgs, use_cache=False)[0]
            s = settled(b, name)["store"]
        assert got == cold, kind
        assert usage.prompt_tokens_details.cached_tokens == 8 * (2 + i), kind
        assert s["bad_values"] == 1 and s["errors"] == 0, kind
        # deleted, and written again whole by b with its turn (b computed that page)
        assert val.check_page(_geo(tiny_lm), page, client.get(key)) and client.get(key) != bad


def _geo(lm) -> Geometry:
    return Geometry(lm.fingerprint, 8, lm.cache_spec)


def test_a_store_with_tiny_memory_gives_partial_hits_and_no_errors(tiny_lm, tiny_lm_again,
                                                                   tmp_path):
    # A writes six chats a second apart (the store's LRU clock ticks once a second; 64 keys
    # sampled), then the store is limited to what it held after the first three (measured, not
    # a fixed --maxmemory that assumes redis-server's own overhead), so it drops about three
    # chats, the oldest. The template's head, which all six share, is in use by each: it stays
    proc = RedisProc(tmp_path / "r", "--maxmemory-policy", "allkeys-lru",
                     "--maxmemory-samples", "64").start()
    client = proc.client()
    name = tiny_lm.name
    try:
        chats, used = [], [client.info("memory")["used_memory"]]
        with running_server([tiny_lm], config(tmp_path / "a", proc.url)) as a:
            for k in range(6):
                doc = {"role": "system", "content": f"({k}) {DOC}", "message_id": f"s{k}"}
                chats.append(run_turns(a, name, f"m{k}", TURNS[:1], [doc]))
                settled(a, name)
                used.append(client.info("memory")["used_memory"])
                time.sleep(1.1)
            wrote = settled(a, name)["store"]
        assert wrote["errors"] == wrote["dropped_pages"] == 0
        assert used[6] - used[3] > 100_000  # three chats' pages
        client.config_set("maxmemory", used[3])
        # commands make the store evict down to its limit; it evicts within a time budget per
        # command and goes on in the background, so a busy machine may need more than one
        deadline = time.monotonic() + 10
        while client.info("memory")["used_memory"] > used[3] and time.monotonic() < deadline:
            client.ping()
            time.sleep(0.05)
        assert client.info("memory")["used_memory"] <= used[3]
        cached, full = [], []
        with running_server([tiny_lm_again], config(tmp_path / "b", proc.url)) as b:
            # newest first: the store's LRU keeps what A wrote last (and B's own writes evict
            # more of A's as it goes), so the first chats B asks for are the likeliest hits
            for k, hist in reversed(list(enumerate(chats))):
                msgs = hist + [{"role": "user", "content": "More?", "message_id": f"x{k}"}]
                got, _, usage = ask(b, name, msgs)
                assert got == ask(b, name, msgs, use_cache=False)[0]
                cached.append(usage.prompt_tokens_details.cached_tokens)
                full.append(usage.prompt_tokens - 8)
            s = settled(b, name)["store"]
        assert s["errors"] == 0 and s["hits"] > 0
        # B's own tier holds one page of each (the chat template's head): more than that came
        # from the store, and less than everything (the store evicted some of it)
        assert cached[0] > 8  # the newest chat (asked first) came from the store
        assert cached[-1] <= 8  # the oldest was evicted: a miss, never an error
        assert sum(cached) < sum(full)
    finally:
        proc.stop()


def test_a_store_killed_and_restarted_costs_reuse_never_an_answer(
        tiny_lm, tiny_lm_again, tmp_path, redis_server, monkeypatch):
    monkeypatch.setattr("kv_cache.tiers.store.connection.COOL_DOWN", 0.5)
    name = tiny_lm.name
    with running_server([tiny_lm], config(tmp_path / "a", redis_server.url)) as a, \
            running_server([tiny_lm_again], config(tmp_path / "b", redis_server.url)) as b:
        h1 = run_turns(a, name, "k1", TURNS[:1])
        redis_server.stop()
        for server, tag in ((a, "k2"), (b, "k3"), (a, "k4"), (b, "k5")):
            msgs = h1 + [{"role": "user", "content": f"Go on ({tag}).", "message_id": tag}]
            got = ask(server, name, msgs)[0]
            assert got == ask(server, name, msgs, use_cache=False)[0]
        down = settled(b, name)["store"]
        assert down["errors"] >= 1 and down["breaker_opens"] >= 1
        redis_server.start()  # empty again
        time.sleep(0.6)
        h2 = run_turns(a, name, "k6", TURNS[:2])
        settled(a, name)
        time.sleep(0.6)
        msgs = h2 + [{"role": "user", "content": TURNS[2], "message_id": "k6-u2"}]
        got, _, usage = ask(b, name, msgs)
        assert got == ask(a, name, msgs)[0]
        assert usage.prompt_tokens_details.cached_tokens > 0
        assert settled(b, name)["store"]["breaker"] == "closed"
        metrics = httpx.get(b.removesuffix("/v1") + "/metrics").text
        assert "kv_store_breaker_opens_total" in metrics and "kv_store_pages_read_total" in metrics


def test_a_wrong_password_is_a_start_up_warning_not_a_crash(tiny_lm, tmp_path, caplog):
    proc = RedisProc(tmp_path / "r", "--requirepass", "right-one").start()
    try:
        url = f"redis://:wrong-one@127.0.0.1:{proc.port}/0"
        with caplog.at_level(logging.WARNING, logger="kv_cache.store"), \
                running_server([tiny_lm], config(tmp_path / "a", url)) as a:
            history = run_turns(a, tiny_lm.name, "p", TURNS[:1])
            assert history[-1]["content"]
        assert "authentication failed" in caplog.text and "wrong-one" not in caplog.text
    finally:
        proc.stop()
