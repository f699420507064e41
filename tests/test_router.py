"""Several servers behind one cache-aware router (``harness/router_proc.py``): three real server
processes on a tiny model share one real redis-server as their page store, behind SGLang's
``sglang-router`` (``cache_aware``: a prefix tree over the request text) or vLLM's
``vllm-router`` (``kv_aware``: the pages each server announces in its KV events, matched with
the request's token ids that the server renders). Each conversation's turns land on one server,
a server killed mid-run loses no conversation (its next turns are answered by another, from the
store), and a greedy answer is the same whichever server gives it. Through ``vllm-router``, the
turns are streamed, and Anthropic's and the Responses API stream through it too.

Which server answered: the answer's entry is in the memory of that server alone (the others
may read it from the store or see it on no disk of theirs, never in their memory).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest

from harness.redis_proc import running_redis
from harness.router_proc import Router, VllmRouter
from harness.server_procs import HTTP, Server, free_port

CONVERSATIONS, TURNS = 6, 4
PAUSE_S = 0.3  # between the turns of a conversation behind vllm-router (see the test)


@contextlib.contextmanager
def running_cluster(model_dir, folder, make_router, *flags: str, each=lambda i: ()):
    """The store, three servers on it (``flags``, and ``each(i)`` for server ``i``) and the
    router ``make_router(urls, log)`` over them, started in that order (the router is found, or
    installed, before any server starts: a missing one skips at once)."""
    with running_redis(folder / "redis") as store:
        servers = [Server(model_dir, folder / f"cache{i}", folder / f"server{i}.log",
                          "--kv-store", store.url, "--page-size", "8", "--max-tokens", "8",
                          *flags, *each(i), warm=True) for i in range(3)]
        router = make_router([s.url for s in servers], folder / "router.log")
        try:
            for s in servers:
                s.start()
            router.start()
            yield router, servers, HTTP.get(f"{servers[0].url}/v1/models").json()["data"][0]["id"]
        finally:
            router.stop()
            for s in servers:
                s.kill()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    """SGLang's router (``cache_aware``) over three servers."""
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("router"), Router) as c:
        yield c


@pytest.fixture(scope="module")
def kv_cluster(tiny_model_dir, tmp_path_factory):
    """vLLM's router (``kv_aware``) over three servers, each publishing its KV events (as maps,
    which is what it reads) on ports of its own."""
    events = [[f"tcp://*:{free_port()}", f"tcp://*:{free_port()}"] for _ in range(3)]

    def router(urls, log):
        return VllmRouter(urls, log, kv_events=events, block_size=8)

    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("kv-router"), router,
                         "--kv-events-format", "map",
                         each=lambda i: ("--kv-events", events[i][0],
                                         "--kv-events-replay", events[i][1])) as c:
        yield c


def ask(url: str, model: str, messages: list[dict]) -> tuple[str, str, int]:
    """A greedy chat answer from ``url``: its text, message id and cached prompt tokens."""
    r = HTTP.post(f"{url}/v1/chat/completions",
                  json={"model": model, "messages": messages, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    message = body["choices"][0]["message"]
    return (message["content"], message["message_id"],
            body["usage"]["prompt_tokens_details"]["cached_tokens"])


def ask_streamed(url: str, model: str, messages: list[dict]) -> tuple[str, str, int]:
    """``ask``, streamed: the text of the deltas, the message id of the chunks, the cached
    prompt tokens of the usage chunk."""
    text, message_id, cached = "", None, None
    with HTTP.stream("POST", f"{url}/v1/chat/completions", json={
            "model": model, "messages": messages, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        for data in sse_data(r):
            message_id = data.get("message_id", message_id)
            text += "".join(c["delta"].get("content") or "" for c in data["choices"])
            if data.get("usage"):
                cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert message_id is not None and cached is not None
    return text, message_id, cached


def sse_data(response) -> list[dict]:
    """The JSON data of a server-sent event stream (``[DONE]`` last, where the API sends it)."""
    lines = [ln.removeprefix("data: ") for ln in response.iter_lines() if ln.startswith("data: ")]
    assert lines, "an empty stream"
    return [json.loads(ln) for ln in lines if ln != "[DONE]"]


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


def test_kv_aware_streams_each_api_and_keeps_a_responses_chat_on_its_server(kv_cluster):
    router, servers, model = kv_cluster
    # Anthropic's Messages API, streamed through the router (which asks no token ids for it)
    with HTTP.stream("POST", f"{router.url}/v1/messages", json={
            "model": model, "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": "Say something about the sea."}]}) as r:
        assert r.status_code == 200, r.read()
        events = [e["type"] for e in sse_data(r)]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events
    # The Responses API, streamed: a chat's second turn (its whole history sent again) goes
    # where the first one went, which holds its pages, and reads them from its cache
    history = [{"role": "user", "content": "Tell me about the tides of the northern sea."}]
    homes, cached = [], []
    for turn in range(2):
        with HTTP.stream("POST", f"{router.url}/v1/responses", json={
                "model": model, "instructions": "Answer in a few words.", "input": history,
                "stream": True, "temperature": 0}) as r:
            assert r.status_code == 200, r.read()
            done = sse_data(r)[-1]  # response.completed, or .incomplete at max_output_tokens
        assert done["type"] in ("response.completed", "response.incomplete"), done
        done = done["response"]
        homes.append(answered_by(servers, done["id"]))
        cached.append(done["usage"]["input_tokens_details"]["cached_tokens"])
        text = "".join(c["text"] for item in done["output"] if item["type"] == "message"
                       for c in item["content"] if c["type"] == "output_text")
        history += [{"role": "assistant", "content": text},
                    {"role": "user", "content": "And the southern one?"}]
    assert len(homes[0]) == 1 and homes[0] == homes[1], homes
    assert cached[1] > 0, cached


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_conversations_keep_their_server_and_survive_one_that_dies(kind, request):
    router, servers, model = request.getfixturevalue("cluster" if kind == "sglang"
                                                     else "kv_cluster")
    if kind == "sglang":  # it filed every server under the model /server_info names
        assert {w["model_id"] for w in router.registered()} == {model}
    ask_router = ask if kind == "sglang" else ask_streamed
    # kv_aware weighs the prefill a server would save against the work it already has: while
    # other requests run there, a turn can go to an idle server instead (which reads its
    # prefix from the store). So behind vllm-router the chats begin at once (spread by load) and
    # then take their turns one at a time, where the pages held decide alone. It learns of a
    # turn's pages from the server's KV events, which leave as the answer is saved: a pause
    # between turns, as a client's, lets them arrive before the next one.
    pause = 0.0 if kind == "sglang" else PAUSE_S
    one_at_a_time = contextlib.nullcontext() if kind == "sglang" else threading.Lock()
    chats: dict[int, list[dict]] = {}
    where: dict[int, list[list[int]]] = {}
    cached: dict[int, list[int]] = {}

    def converse(k: int) -> None:  # several at once: the router spreads new prefixes by load
        messages = [{"role": "system", "content": f"Chat {k}: speak of the number {k * 37} "
                                                  "and of nothing else, in a few words."}]
        where[k], cached[k] = [], []
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Turn {turn}: what about {k}?"})
            with one_at_a_time if turn else contextlib.nullcontext():
                text, mid, hit = ask_router(router.url, model, messages)
            messages.append({"role": "assistant", "content": text})
            where[k].append(answered_by(servers, mid))
            cached[k].append(hit)
            time.sleep(pause)
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
        text, mid, hit = ask_router(router.url, model, messages)
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
