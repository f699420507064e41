"""Bad requests: each gets its 4xx status and an OpenAI-shaped JSON error; the server goes on."""

from __future__ import annotations

import httpx
import pytest

from mlx_kvserver.config import ServerConfig
from harness.server_utils import running_server

OK = [{"role": "user", "content": "hi"}]

CASES = [
    # (name, body or raw bytes, status, param or code fragment)
    ("not json", b"{not json", 400, None),
    ("not an object", [1, 2], 400, None),
    ("no messages", {}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("messages not a list", {"messages": "hi"}, 400, "messages"),
    ("message not an object", {"messages": ["hi"]}, 400, "messages[0]"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("content wrong type", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ("continue a tool call", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     400, "messages"),
    ("tool result for an unknown call", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "tool", "tool_call_id": "nope", "content": "42"}]}, 400, "messages"),
    ("tool result before its call", {"messages": [
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "user", "content": "x"}]}, 400, "messages"),
    ("tools not a list", {"messages": OK, "tools": {"type": "function"}}, 400, "tools"),
    ("tool not a function", {"messages": OK, "tools": [{"type": "web_search"}]}, 400, "tools"),
    ("tool schema not JSON Schema", {"messages": OK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objekt"}}}]}, 400, "tools[0].function"),
    ("tool name with spaces", {"messages": OK, "tools": [{"type": "function", "function": {
        "name": "get weather"}}]}, 400, "tools[0].function.name"),
    ("tool_choice names an unknown tool", {"messages": OK, "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "tool_choice": {"type": "function", "function": {"name": "other"}}}, 400, "tool_choice"),
    ("tool_choice required without tools", {"messages": OK, "tool_choice": "required"}, 400,
     "tool_choice"),
    ("tool_choice wrong", {"messages": OK, "tool_choice": "always"}, 400, "tool_choice"),
    ("response_format wrong type", {"messages": OK, "response_format": {"type": "xml"}}, 400,
     "response_format"),
    ("response schema not JSON Schema", {"messages": OK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}, 400,
     "response_format.json_schema.schema"),
    ("top_logprobs too many", {"messages": OK, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("reasoning_effort unknown", {"messages": OK, "reasoning_effort": "max"}, 400,
     "reasoning_effort"),
    ("message_id wrong type", {"messages": [{"role": "user", "content": "x", "message_id": 3}]},
     400, "messages[0].message_id"),
    ("message_id with NUL", {"messages": [{"role": "user", "content": "x",
                                           "message_id": "a\u0000b"}]}, 400,
     "messages[0].message_id"),
    ("message_id too long", {"messages": [{"role": "user", "content": "x",
                                           "message_id": "a" * 10_000}]}, 400,
     "messages[0].message_id"),
    ("max_tokens zero", {"messages": OK, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens string", {"messages": OK, "max_tokens": "5"}, 400, "max_tokens"),
    ("max_tokens float", {"messages": OK, "max_tokens": 2.5}, 400, "max_tokens"),
    ("temperature too high", {"messages": OK, "temperature": 5}, 400, "temperature"),
    ("temperature negative", {"messages": OK, "temperature": -1}, 400, "temperature"),
    ("top_p too high", {"messages": OK, "top_p": 1.5}, 400, "top_p"),
    ("n zero", {"messages": OK, "n": 0}, 400, "n"),
    ("n huge", {"messages": OK, "n": 1000}, 400, "n"),
    ("stream not bool", {"messages": OK, "stream": "yes"}, 400, "stream"),
    ("use_kv_cache not bool", {"messages": OK, "use_kv_cache": 1}, 400, "use_kv_cache"),
    ("stop wrong type", {"messages": OK, "stop": 5}, 400, "stop"),
    ("stop empty string", {"messages": OK, "stop": [""]}, 400, "stop"),
    ("seed negative", {"messages": OK, "seed": -1}, 400, "seed"),
    ("seed not whole", {"messages": OK, "seed": 1.5}, 400, "seed"),
    ("stream_options wrong", {"messages": OK, "stream_options": 3}, 400, "stream_options"),
    ("unknown model", {"messages": OK, "model": "nope"}, 404, "model"),
]


@pytest.fixture(scope="module")
def server(tiny_lm):
    config = ServerConfig(max_tokens=4, max_body_bytes=64 * 1024)
    with running_server([tiny_lm], config) as url:
        yield url


@pytest.mark.parametrize("name,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, name, body, status, param):
    if isinstance(body, bytes):
        r = httpx.post(f"{server}/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(f"{server}/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param


def test_body_over_limit_is_413(server):
    big = {"messages": [{"role": "user", "content": "x" * 100_000}]}
    r = httpx.post(f"{server}/chat/completions", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_prompt_longer_than_context_is_400(server, tiny_lm):
    words = " ".join(["word"] * (tiny_lm.context_length + 10))
    r = httpx.post(f"{server}/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": words[:60_000]}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    streamed = httpx.post(f"{server}/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": words[:60_000]}],
                                "stream": True})
    assert streamed.status_code == 400


def test_unknown_route_and_method(server):
    assert httpx.get(f"{server}/nope").status_code == 404
    r = httpx.get(f"{server}/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert r.headers["allow"] == "POST"


def test_null_optional_fields_and_whole_float_integers_are_accepted(server):
    # As the OpenAPI description says: null is an absent field; 7.0 is an integer.
    nulls = {k: None for k in ("model", "max_tokens", "temperature", "top_p", "n", "seed", "stop",
                               "stream", "stream_options", "use_kv_cache")}
    body = {"messages": [{"role": "user", "content": "hi", "message_id": None}], **nulls}
    r = httpx.post(f"{server}/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server}/chat/completions", timeout=60,
                   json={"messages": OK, "seed": 7.0, "n": 2.0, "max_tokens": 2.0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


MSG = {"model": "default", "max_tokens": 2, "messages": OK}
RESP = {"input": "hi", "max_output_tokens": 2}
CMPL = {"prompt": "hi", "max_tokens": 2}
WRONG_TYPES = [  # (path, body, param): a value of the wrong type, each API its own shape
    # the fuzzer's two 500s (an object where a string is looked up), and their kind
    *[(path, {**MSG, "tool_choice": {"type": kind}}, "tool_choice")
      for path in ("/messages", "/messages/count_tokens")
      for kind in ({}, [], ["auto"], {"auto": 1})],
    ("/messages", {**MSG, "thinking": {"type": {}}}, "thinking"),
    ("/messages", {**MSG, "output_config": {"format": {"type": []}}}, "output_config.format"),
    ("/messages", {**MSG, "output_format": {"type": []},
                   "output_config": {"format": None}}, "output_format"),
    ("/messages", {**MSG, "tools": [{"name": "f", "input_schema": {}, "type": {}}]}, "tools"),
    ("/responses", {**RESP, "reasoning": {"effort": {}}}, "reasoning.effort"),
    ("/responses", {**RESP, "tools": [{"type": "namespace", "name": "ns", "tools": [
        {"type": {}, "name": "f"}]}]}, "tools"),
    # a falsy value is not an absent one: only null is
    ("/completions", {**CMPL, "stream_options": False}, "stream_options"),
    *[("/chat/completions", {"messages": OK, field: value}, field)
      for field in ("stream_options", "chat_template_kwargs") for value in (False, 0, "", [])],
    *[("/messages", {**MSG, field: value}, field)
      for field in ("metadata", "output_config", "mcp_servers") for value in (False, 0, "")],
    *[("/responses", {**RESP, field: value}, field)
      for field in ("text", "reasoning", "include", "metadata") for value in (False, 0, "")],
    ("/responses", {**RESP, "top_logprobs": "3"}, "top_logprobs"),
    ("/chat/completions", {"messages": OK, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format.json_schema"),
    # each API's own tool_choice shape
    ("/responses", {**RESP, "tools": [{"type": "function", "name": "f"}],
                    "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ("/chat/completions", {"messages": OK, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
]


@pytest.mark.parametrize("path,body,param", WRONG_TYPES,
                         ids=[f"{p} {sorted(b.keys() - {'model', 'messages'})}" for p, b, _ in
                              WRONG_TYPES])
def test_a_wrong_type_is_a_400_in_the_api_s_own_shape(server, path, body, param):
    r = httpx.post(server + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    if path.startswith("/messages"):
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
    else:
        assert r.json()["error"]["param"].startswith(param), r.text


@pytest.mark.parametrize("path,body", [
    ("/completions", {**CMPL, "prompt": [1.0, 2.0, 3], "logprobs": 1.0}),
    ("/completions", {**CMPL, "prompt": [[4.0, 5]], "model": 0.0}),
    ("/messages", {**MSG, "thinking": {"type": "enabled", "budget_tokens": 16.0}}),
    ("/messages", {**MSG, "mcp_servers": []}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "reasoning_content": None, "reasoning": "hm", "content": "x"}]}),
])
def test_whole_floats_are_integers_and_nulls_are_absent_in_every_api(server, path, body):
    r = httpx.post(server + path, json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_server_still_answers_after_bad_requests(server):
    for _, body, _, _ in CASES[:5]:
        httpx.post(f"{server}/chat/completions", json=body if not isinstance(body, bytes)
                   else None, content=body if isinstance(body, bytes) else None, timeout=30)
    r = httpx.post(f"{server}/chat/completions", json={"messages": OK, "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
