"""Stored responses shared through the KV store (``storage/shared_responses.py``): a response
created on one server is continued on another by ``previous_response_id``, both on one real
redis-server; a store that fails or holds a bad value is a miss, never an error."""

from __future__ import annotations

import json

import httpx
import pytest

from mlx_kvserver.config import ServerConfig
from mlx_kvserver.storage.responses import FORMAT, ResponseStore
from mlx_kvserver.storage.shared_responses import SharedResponses, connect, record_key
from harness.redis_proc import running_redis
from harness.server_utils import running_server


@pytest.fixture
def redis_server(tmp_path):
    with running_redis(tmp_path / "redis") as proc:
        yield proc


def config(folder, url):
    return ServerConfig(max_tokens=8, page_size=8, kv_cache_dir=folder, kv_store=url)


def respond(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/responses", json=body, timeout=60)


def test_a_response_made_on_one_server_is_continued_on_another(tiny_lm, tmp_path,
                                                               redis_server):
    name = tiny_lm.name
    with running_server([tiny_lm], config(tmp_path / "a", redis_server.url)) as a:
        first = respond(a, model=name, input="Tell me about the sea.").json()
    rid = first["id"]
    with running_server([tiny_lm], config(tmp_path / "b", redis_server.url)) as b:
        on_b = respond(b, model=name, input="And the mountains?", previous_response_id=rid)
        got = httpx.get(f"{b}/responses/{rid}")
    with running_server([tiny_lm], config(tmp_path / "a", redis_server.url)) as a:
        on_a = respond(a, model=name, input="And the mountains?", previous_response_id=rid)
    with running_server([tiny_lm], config(tmp_path / "c", None)) as c:  # no store: not found
        alone = respond(c, model=name, input="And the mountains?", previous_response_id=rid)
    assert on_b.status_code == on_a.status_code == got.status_code == 200, on_b.text
    assert got.json()["id"] == rid and got.json()["output"] == first["output"]
    assert on_b.json()["output"][-1]["content"] == on_a.json()["output"][-1]["content"]
    assert on_b.json()["usage"]["input_tokens"] == on_a.json()["usage"]["input_tokens"]
    assert alone.status_code == 404


def test_a_bad_value_or_a_failing_store_is_a_miss(tmp_path, redis_server):
    client = redis_server.client()
    store = SharedResponses(ResponseStore(None), connect(redis_server.url), "ns")
    assert store.put("r1", {"response": {"id": "r1"}, "history": []})
    fresh = SharedResponses(ResponseStore(None), connect(redis_server.url), "ns")
    assert fresh.get("r1") == {"response": {"id": "r1"}, "history": []}  # from the store
    key = record_key("ns", "r2")
    client.set(key, json.dumps({"format": FORMAT, "id": "another", "record": {}}))
    assert fresh.get("r2") is None and client.get(key) is None  # not its id: deleted
    assert fresh.delete("r1") and client.get(record_key("ns", "r1")) is None
    redis_server.stop()
    assert store.get("r9") is None  # the store is gone: a miss, and none asked meanwhile
    assert store.put("r3", {"response": {}, "history": []})  # kept locally all the same
    assert store.get("r3") == {"response": {}, "history": []}
