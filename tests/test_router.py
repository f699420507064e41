"""Several servers behind one cache-aware router (SGLang's ``sglang-router``, ``harness/
router_proc.py``): three real server processes on a tiny model share one real redis-server as
their page store. Each conversation's turns land on one server (the router's prefix tree over
the request text), a server killed mid-run loses no conversation (its next turns are answered by
another, from the store), and a greedy answer is the same whichever server gives it.

Which server answered: the answer's entry is in the memory of that server alone (the others
may read it from the store or see it on no disk of theirs, never in their memory).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from harness.redis_proc import running_redis
from harness.router_proc import Router
from harness.server_procs import HTTP, Server

CONVERSATIONS, TURNS = 6, 4


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    """The store, three servers on it, and the router over them (started in that order)."""
    folder = tmp_path_factory.mktemp("router")
    with running_redis(folder / "redis") as store:
        servers = [Server(tiny_model_dir, folder / f"cache{i}", folder / f"server{i}.log",
                          "--kv-store", store.url, "--page-size", "8", "--max-tokens", "8",
                          warm=True) for i in range(3)]
        router = Router([s.url for s in servers], folder / "router.log")  # skips if none
        try:
            for s in servers:
                s.start()
            router.start()
            yield router, servers, HTTP.get(f"{servers[0].url}/v1/models").json()["data"][0]["id"]
        finally:
            router.stop()
            for s in servers:
                s.kill()


def ask(url: str, model: str, messages: list[dict]) -> tuple[str, str, int]:
    """A greedy chat answer from ``url``: its text, message id and cached prompt tokens."""
    r = HTTP.post(f"{url}/v1/chat/completions",
                  json={"model": model, "messages": messages, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    message = body["choices"][0]["message"]
    return (message["content"], message["message_id"],
            body["usage"]["prompt_tokens_details"]["cached_tokens"])


def answered_by(servers: list[Server], message_id: str) -> list[int]:
    """The servers (by index) that hold the answer's entry in memory: the one that gave it."""
    out = []
    for i, s in enumerate(servers):
        if s.proc.poll() is not None:
            continue
        r = HTTP.get(f"{s.url}/v1/kv_cache/{message_id}")
        if r.status_code == 200 and r.json()["in_memory"]:
            out.append(i)
    return out


def settled(server: Server, model: str) -> None:
    """Wait for ``server``'s writes to the store (they run after each answer)."""
    for _ in range(500):
        stats = HTTP.get(f"{server.url}/v1/kv_cache/stats").json()["models"][model]
        if stats["store"]["queued"] == 0:
            return
        time.sleep(0.02)
    raise AssertionError("the store writes did not finish")


def test_conversations_keep_their_server_and_survive_one_that_dies(cluster):
    router, servers, model = cluster
    # The router filed every server under the model its /server_info names: one prefix tree
    assert {w["model_id"] for w in router.registered()} == {model}
    chats: dict[int, list[dict]] = {}
    where: dict[int, list[list[int]]] = {}
    cached: dict[int, list[int]] = {}

    def converse(k: int) -> None:  # several at once: the router spreads new prefixes by load
        messages = [{"role": "system", "content": f"Chat {k}: speak of the number {k * 37} "
                                                  "and of nothing else, in a few words."}]
        where[k], cached[k] = [], []
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Turn {turn}: what about {k}?"})
            text, mid, hit = ask(router.url, model, messages)
            messages.append({"role": "assistant", "content": text})
            where[k].append(answered_by(servers, mid))
            cached[k].append(hit)
        chats[k] = messages

    threads = [threading.Thread(target=converse, args=(k,)) for k in range(CONVERSATIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(chats) == list(range(CONVERSATIONS))
    home = {}
    for k in range(CONVERSATIONS):
        assert all(len(w) == 1 for w in where[k]), where[k]
        assert len({w[0] for w in where[k]}) == 1, f"chat {k} moved: {where[k]}"
        home[k] = where[k][0][0]
        assert all(hit > 0 for hit in cached[k][1:]), cached[k]  # each turn reads the last

    # begun at once, new chats went where fewer requests ran: more than one server has chats
    assert len(set(home.values())) >= 2, home
    # The server of chat 0 dies (its writes to the store done): its chats go on elsewhere
    victim = home[0]
    settled(servers[victim], model)
    servers[victim].kill()
    moved = [k for k in range(CONVERSATIONS) if home[k] == victim]
    for k in range(CONVERSATIONS):
        messages = chats[k] + [{"role": "user", "content": "And one more thing?"}]
        text, mid, hit = ask(router.url, model, messages)
        (now,) = answered_by(servers, mid)
        if k in moved:
            assert now != victim and hit > 0, (k, now, hit)  # from the store, not recomputed
        else:
            assert now == home[k], (k, now, home[k])
        # greedy: the same answer from every server still up, whoever answered first
        for s in servers:
            if s.proc.poll() is None:
                assert ask(s.url, model, messages)[0] == text, (k, s.url)


def test_the_worker_routes_answer_in_the_routers_shapes(cluster):
    _, servers, model = cluster
    url = next(s.url for s in servers if s.proc.poll() is None)
    info = httpx.get(f"{url}/server_info").json()
    assert info["model_path"] == info["served_model_name"] == model
    assert httpx.get(f"{url}/model_info").json()["model_path"] == model
    assert httpx.get(f"{url}/health_generate").status_code == 200
    load = httpx.get(f"{url}/get_load").json()
    assert load["loads"][0]["dp_rank"] == 0 and load["load"] == 0
    assert load["server"]["pages_held"] >= 0 and load["server"]["memory"]["free_bytes"] > 0
