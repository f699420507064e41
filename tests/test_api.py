"""The HTTP API through the official openai client and raw HTTP, on a real uvicorn server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from mlx_kvserver.config import ServerConfig
from harness.server_utils import running_server

HELLO = [{"role": "user", "content": "hello there", "message_id": "u1"}]


@pytest.fixture(scope="module")
def server(tiny_lm, tiny_lm_b):
    with running_server([tiny_lm, tiny_lm_b], ServerConfig(max_tokens=8)) as url:
        yield url


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0)


def test_non_streaming_answer_carries_message_id_and_usage(client, tiny_lm):
    r = client.chat.completions.create(model=tiny_lm.name, messages=HELLO, max_tokens=6)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    mid = choice.message.model_extra["message_id"]
    assert mid.startswith("msg-") and r.model_extra["message_id"] == mid
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_streaming_matches_non_streaming_and_ends_with_usage(client, tiny_lm):
    messages = [{"role": "user", "content": "stream me", "message_id": "s1"}]
    full = client.chat.completions.create(model=tiny_lm.name, messages=messages,
                                          max_tokens=8, extra_body={"use_kv_cache": False})
    chunks = list(client.chat.completions.create(
        model=tiny_lm.name, messages=messages, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"use_kv_cache": False}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    ids = {c.model_extra["message_id"] for c in chunks if c.choices}
    assert len(ids) == 1 and ids.pop().startswith("msg-")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        full.usage.completion_tokens


def test_sse_wire_format_ends_with_done(server, tiny_lm):
    with httpx.stream("POST", f"{server}/chat/completions", timeout=60,
                      json={"messages": HELLO, "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        body = json.loads(ln.removeprefix("data: "))
        assert body["object"] == "chat.completion.chunk" and "message_id" in body


def test_n_choices_get_distinct_message_ids(client, tiny_lm):
    r = client.chat.completions.create(model=tiny_lm.name, messages=HELLO, max_tokens=4, n=3,
                                       temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.model_extra["message_id"] for c in r.choices}) == 3


def test_models_health_and_model_selection(server, client, tiny_lm, tiny_lm_b):
    ids = [m.id for m in client.models.list().data]
    assert ids == [tiny_lm.name, tiny_lm_b.name]
    assert httpx.get(server.removesuffix("/v1") + "/health").json()["status"] == "ok"
    by_index = httpx.post(f"{server}/chat/completions", headers={"X-Model-Id": "1"},
                          json={"messages": HELLO, "max_tokens": 2}, timeout=60)
    assert by_index.status_code == 200 and by_index.json()["model"] == tiny_lm_b.name
    by_name = client.chat.completions.create(model=tiny_lm_b.name, messages=HELLO, max_tokens=2)
    assert by_name.model == tiny_lm_b.name
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    assert e.value.body["code"] == "model_not_found"


def test_model_default_or_omitted_is_the_first_served_model(server, client, tiny_lm, tiny_lm_b):
    named = client.chat.completions.create(model="default", messages=HELLO, max_tokens=2)
    assert named.model == tiny_lm.name
    omitted = httpx.post(f"{server}/chat/completions", json={"messages": HELLO, "max_tokens": 2},
                         timeout=60)
    assert omitted.status_code == 200 and omitted.json()["model"] == tiny_lm.name
    header = httpx.post(f"{server}/chat/completions", headers={"X-Model-Id": "default"},
                        json={"messages": HELLO, "max_tokens": 2}, timeout=60)
    assert header.status_code == 200 and header.json()["model"] == tiny_lm.name
    r = httpx.post(f"{server}/chat/completions", timeout=60,
                   json={"messages": HELLO, "max_tokens": 2, "model": "gpt-4o"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert err["message"] == (f"model 'gpt-4o' not found; served: {tiny_lm.name}, "
                              f"{tiny_lm_b.name} (serve it under another name with "
                              "--model-alias NAME=SERVED, or let requests load it with "
                              "--allow-models PATTERN)")


def test_api_key_required_except_health(tiny_lm):
    with running_server([tiny_lm], ServerConfig(api_key="s3cret", max_tokens=2)) as url:
        root = url.removesuffix("/v1")
        assert httpx.get(f"{root}/health").status_code == 200
        assert httpx.get(f"{url}/models").status_code == 401
        bad = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=tiny_lm.name, messages=HELLO)
        good = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model=tiny_lm.name, messages=HELLO).choices
