"""Load: 16 concurrent streaming clients of 10 turns each, some hanging up mid-answer.

Every completed answer must equal the answer the same conversation gets alone (greedy, no cache):
no cross-talk between sequences that share the worker, the page pool and the disk store. Once
everyone is done, no page may be held by a sequence (each page's ref count is exactly the number
of cache entries holding it) and both budgets (RAM pool, disk store) hold.

The helpers ``cache_figures`` / ``assert_cache_at_rest`` are used by the other reliability tests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections import Counter
from pathlib import Path

import httpx

from kv_cache.pages.holders import ENTRY, SEQUENCE
from kv_cache.tiers.disk import atomic_fs
from mlx_kvserver.config import ServerConfig
from harness.server_utils import make_engine, running_server

CLIENTS, TURNS, MAX_TOKENS = 16, 10, 8
HANG_UP = {(c, t) for c in range(0, CLIENTS, 3) for t in (1, 4, 8)}  # (client, turn)
TOPICS = ["the sea", "mountains", "rivers", "cities", "music", "bread", "stars", "trees",
          "rain", "books", "trains", "birds", "snow", "gold", "glass", "clocks"]


# -- shared checks ---------------------------------------------------------------------------------


def skip_fsync(monkeypatch) -> None:
    """Durability is not what these tests check (tests/test_faults.py kills real processes);
    fsync on a shared disk would take most of their time."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    monkeypatch.setattr(atomic_fs, "fsync_file", lambda fd: None)


def disk_file_bytes(root: Path) -> int:
    """Bytes of the store files (pages and manifests) under a cache directory."""
    return sum(p.stat().st_size for p in Path(root).rglob("*.safetensors")
               if p.is_file() and not p.is_symlink())


def cache_figures(engine) -> dict:
    """Per model, computed on the worker thread (after every queued job): pages a running
    sequence still holds (ref count, holds by the cache's own holders: entries, resident
    sequences, the prefix views they read), entries' pages whose holds differ from the entries'
    tables, RAM and disk bytes and budgets. The pool counts every page's holds by kind of holder
    (``kv_cache.pages.holders``), so this reads them there."""

    def measure() -> dict:
        out = {}
        for name, m in engine.managers.items():
            pool = m.pool
            tables = Counter(b for key in m.keys() for t in m.get(key).tables  # noqa: SIM118
                             for b in t if b is not None)
            entry_holds = pool.holders.held_by(ENTRY)
            refs = pool.ref_counts()
            stats = pool.stats()
            disk = m.store.stats() if m.store is not None else None
            out[name] = {
                "wrong_refs": {b: (refs[b], refs[b] - n)
                               for b, n in pool.holders.held_by(SEQUENCE).items()},
                "wrong_entry_holds": {b: (entry_holds.get(b, 0), tables.get(b, 0))
                                      for b in set(tables) | set(entry_holds)
                                      if entry_holds.get(b, 0) != tables.get(b, 0)},
                "missing": sorted(set(tables) - set(refs)),
                "entries": len(m), "pages": stats.used_pages, "pages_held": stats.held_pages,
                "ram_bytes": stats.used_bytes, "ram_budget": pool.max_bytes,
                "disk_bytes": disk.bytes_on_disk if disk else 0,
                "disk_budget": disk.budget if disk else 0,
                "disk_root": str(m.store.root) if m.store is not None else None,
            }
        return out

    return asyncio.run(engine.call(measure))


def assert_cache_at_rest(engine) -> dict:
    """No page held by a sequence, every entry's pages resident, both budgets kept (the disk's
    counted by the store and by the files themselves)."""
    figures = cache_figures(engine)
    for name, f in figures.items():
        assert f["wrong_refs"] == {}, f"{name}: pages held beyond entries: {f['wrong_refs']}"
        assert f["wrong_entry_holds"] == {}, f"{name}: {f['wrong_entry_holds']}"
        assert f["missing"] == [], f"{name}: entries hold freed pages {f['missing']}"
        assert f["ram_bytes"] <= f["ram_budget"], f
        assert f["disk_bytes"] <= f["disk_budget"], f
        if f["disk_root"]:
            assert disk_file_bytes(Path(f["disk_root"])) <= f["disk_budget"], f
    return figures


# -- the load test ---------------------------------------------------------------------------------


def user_text(client: int, turn: int) -> str:
    return f"Client {client}, turn {turn}: tell me about {TOPICS[(client + turn) % 16]}."


def ask(http: httpx.Client, url: str, messages: list, *, stream: bool, use_cache: bool = True,
        max_tokens: int = MAX_TOKENS, hang_up: bool = False):
    """(content, message_id); with ``hang_up`` the connection is closed at the first content."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, "use_kv_cache": use_cache}
    if not stream:
        r = http.post(f"{url}/chat/completions", json=body)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        return msg["content"], msg["message_id"]
    text, mid, done = [], None, False
    with http.stream("POST", f"{url}/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            mid = chunk["message_id"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    text.append(choice["delta"]["content"])
                    if hang_up:
                        return None, None  # closes the connection mid-answer
    assert done
    return "".join(text), mid


def conversation(http, url, client: int, expected: list[str] | None, failures: list,
                 use_cache: bool = True, stream: bool = True) -> list[str]:
    messages, answers = [], []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": user_text(client, turn),
                         "message_id": f"c{client}-u{turn}"})
        if expected is not None and (client, turn) in HANG_UP:
            ask(http, url, messages, stream=True, max_tokens=300, hang_up=True)
        content, mid = ask(http, url, messages, stream=stream, use_cache=use_cache)
        if expected is not None and content != expected[turn]:
            failures.append((client, turn, content, expected[turn]))
        answers.append(content)
        messages.append({"role": "assistant", "content": content, "message_id": mid})
    return answers


def test_sixteen_streaming_clients_no_cross_talk_nothing_leaks(tiny_lm, tmp_path, caplog,
                                                               monkeypatch):
    skip_fsync(monkeypatch)
    # Budgets small enough that entries are dropped from memory and evicted from disk meanwhile.
    page_bytes = tiny_lm.num_layers * 2 * tiny_lm.num_kv_heads * 8 * tiny_lm.head_dim * 4
    config = ServerConfig(max_tokens=MAX_TOKENS, page_size=8, kv_cache_dir=tmp_path / "kv",
                          max_kv_ram_gb=400 * page_bytes / (1 << 30),
                          max_kv_size_gb=300 * page_bytes / (1 << 30))
    # The single-client answers: each conversation alone on a memory-only server; two of them
    # also without any cache (the cache's own exactness is pinned elsewhere; this is quicker).
    with running_server([tiny_lm], ServerConfig(max_tokens=MAX_TOKENS, page_size=8)) as solo:
        with httpx.Client(timeout=120) as http:
            expected = [conversation(http, solo, c, None, [], stream=False)
                        for c in range(CLIENTS)]
            for c in (0, CLIENTS - 1):
                assert conversation(http, solo, c, None, [], use_cache=False) == expected[c]
    assert len({tuple(e) for e in expected}) == CLIENTS  # conversations really differ
    engine = make_engine([tiny_lm], config)
    caplog.set_level(logging.INFO, logger="mlx_kvserver.engine")
    with running_server([tiny_lm], config, engine=engine) as url:
        failures: list = []
        errors: list = []

        def client(c: int) -> None:
            try:
                with httpx.Client(timeout=300) as http:
                    conversation(http, url, c, expected[c], failures)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append((c, repr(e)))

        threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not errors, errors
        assert not failures, failures[:3]
        figures = assert_cache_at_rest(engine)[tiny_lm.name]
        stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][tiny_lm.name]
    cancelled = sum("cancelled by the client" in r.getMessage() for r in caplog.records)
    assert cancelled >= 1, "no hang-up reached the worker mid-answer"
    assert stats["hits"] > 0 and stats["ram"]["pages_held"] == figures["pages_held"]
    # The budgets were small enough to matter: memory entries were dropped, disk evicted.
    assert stats["ram"]["entries"] < CLIENTS * TURNS * 2 and stats["disk"]["evictions"] > 0
