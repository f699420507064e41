"""A request's prompt as token ids in vLLM's shapes (``api/tokenize.py``), what vLLM's router asks
of a server to score it by the KV pages it holds: the render routes give the ids each generating
route runs (the count its answer reports), ``/tokenize`` the same for a chat or a prompt,
``/detokenize`` the text back; bad bodies are 400s and the API key guards them all."""

from __future__ import annotations

import httpx
import pytest

from mlx_kvserver.chat.render import encode
from mlx_kvserver.chat.support import chat_support
from mlx_kvserver.chat.conversation import Conversation, Message, Text
from mlx_kvserver.config import ServerConfig
from harness.server_utils import running_server

CHAT = [{"role": "system", "content": "Speak of the sea."},
        {"role": "user", "content": "Tell me about the tides, at length."}]


@pytest.fixture(scope="module")
def base(tiny_lm, tmp_path_factory):
    config = ServerConfig(max_tokens=3, page_size=8, kv_cache_dir=tmp_path_factory.mktemp("kv"))
    with running_server([tiny_lm], config) as url:
        yield url.removesuffix("/v1")


def post(base: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=60, **kw)


def test_each_render_gives_the_ids_its_route_runs(base, tiny_lm):
    chat = {"model": tiny_lm.name, "messages": CHAT, "temperature": 0}
    rendered = post(base, "/v1/chat/completions/render", chat).json()
    expected, _ = encode(tiny_lm.tokenizer, chat_support(tiny_lm).format,
                         Conversation(messages=[Message(m["role"], [Text(m["content"])])
                                                for m in CHAT]))
    assert rendered["token_ids"] == expected and rendered["model"] == tiny_lm.name
    answer = post(base, "/v1/chat/completions", chat).json()
    assert answer["usage"]["prompt_tokens"] == len(expected)
    # the same conversation through the Responses API, and /tokenize (vLLM's chat form)
    response = post(base, "/v1/responses/render", {
        "model": tiny_lm.name, "instructions": CHAT[0]["content"],
        "input": CHAT[1]["content"]}).json()
    tokens = post(base, "/tokenize", {"model": tiny_lm.name, "messages": CHAT,
                                      "continue_final_message": False}).json()
    assert response["token_ids"] == tokens["tokens"] == expected
    assert tokens["count"] == len(expected) and tokens["max_model_len"] == \
        tiny_lm.context_length
    # a completion's prompt: a string encoded as it runs, token ids as they are
    text = post(base, "/v1/completions/render", {"prompt": "the quick brown fox"}).json()
    assert text["token_ids"] == tiny_lm.tokenizer.encode("the quick brown fox") == \
        post(base, "/tokenize", {"prompt": "the quick brown fox"}).json()["tokens"]
    assert post(base, "/v1/completions/render",
                {"prompt": [5, 6, 7]}).json()["token_ids"] == [5, 6, 7]
    back = post(base, "/detokenize", {"tokens": text["token_ids"]}).json()
    assert back == {"prompt": tiny_lm.tokenizer.decode(text["token_ids"])}
    assert "quick brown fox" in back["prompt"]


def test_bad_bodies_are_400s_and_an_unknown_previous_response_a_404(base, tiny_lm):
    cases = [("/v1/chat/completions/render", {"messages": []}, "messages"),
             ("/v1/completions/render", {"prompt": ""}, "prompt"),
             ("/v1/responses/render", {"input": 7}, "input"),
             ("/tokenize", {"messages": CHAT, "add_generation_prompt": False},
              "add_generation_prompt"),
             ("/tokenize", {}, "prompt"),
             ("/detokenize", {"tokens": ["a"]}, "tokens"),
             ("/detokenize", {"tokens": [10**9]}, "tokens")]
    for path, body, param in cases:
        r = post(base, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    r = post(base, "/v1/responses/render", {"input": "hi", "previous_response_id": "resp_x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_the_api_key_guards_them(tiny_lm):
    with running_server([tiny_lm], ServerConfig(max_tokens=2, api_key="k")) as url:
        base = url.removesuffix("/v1")
        bare = post(base, "/tokenize", {"prompt": "hi"}).status_code
        keyed = post(base, "/v1/chat/completions/render", {"messages": CHAT},
                     headers={"Authorization": "Bearer k"})
    assert bare == 401 and keyed.status_code == 200 and keyed.json()["token_ids"]
