"""``/v1/chat/completions`` beyond plain text, through the official ``openai`` client against a
live server: tools reach the prompt (native template or the documented fallback), reasoning comes
back apart from the answer, thinking switches, logprobs, a continued assistant message, model
aliases; forced tool calls and JSON schemas (grammar-constrained) round trip."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from mlx_kvserver.config import ServerConfig
from mlx_kvserver.models.loading import resolve_and_load
from tests.chat.tiny_chat_model import make_tiny_chat_model_dir
from harness.server_utils import running_server
from tests.chat.pictures import data_url, png

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
HI = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny model with Qwen3's tokens and a thinking template that opens the think block."""
    return resolve_and_load(str(make_tiny_chat_model_dir(
        tmp_path_factory.mktemp("q3") / "tiny-qwen3", "qwen3_strict")))


@pytest.fixture(scope="module")
def server(tiny_lm, qwen3, tmp_path_factory):
    config = ServerConfig(max_tokens=6, kv_cache_dir=tmp_path_factory.mktemp("kv"),
                          model_aliases=[("gpt-*", tiny_lm.name)])
    with running_server([tiny_lm, qwen3], config) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0)


def test_tools_reach_the_prompt_on_a_template_without_tools(client, tiny_lm):
    """The tiny model's ChatML template renders no tools: the fallback puts them in the system
    prompt, so the prompt grows by the tool block (never silently dropped)."""
    plain = client.chat.completions.create(model=tiny_lm.name, messages=HI, max_tokens=1)
    tools = client.chat.completions.create(model=tiny_lm.name, messages=HI, max_tokens=1,
                                           tools=[WEATHER])
    assert tools.usage.prompt_tokens > plain.usage.prompt_tokens + 30
    none = client.chat.completions.create(model=tiny_lm.name, messages=HI, max_tokens=1,
                                          tools=[WEATHER], tool_choice="none")
    assert none.usage.prompt_tokens == tools.usage.prompt_tokens  # the choice is not rendered


def test_reasoning_is_returned_apart_from_the_answer(client, qwen3, server):
    """The template opens a think block: what the model writes is reasoning until it closes
    it, and equals the raw completion of the same prompt, token for token."""
    r = client.chat.completions.create(model=qwen3.name, messages=HI, max_tokens=6,
                                       temperature=0)
    msg = r.choices[0].message
    reasoning = msg.model_extra.get("reasoning_content")
    raw = httpx.post(f"{server}/completions", timeout=60, json={
        "model": qwen3.name, "max_tokens": 6, "temperature": 0,
        "prompt": "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
                  "<|im_start|>assistant\n<think>\n"}).json()
    raw_text = raw["choices"][0]["text"]
    assert reasoning and "</think>" not in raw_text
    assert reasoning == raw_text.strip() and not (msg.content or "").strip()
    stream = client.chat.completions.create(model=qwen3.name, messages=HI, max_tokens=6,
                                            temperature=0, stream=True)
    pieces = [(c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
              for c in stream if c.choices]
    assert "".join(pieces) == reasoning


def test_reasoning_tokens_are_counted_in_every_api(client, qwen3, server):
    """The template opens a think block and the model never closes it in 6 tokens: all 6 are
    reasoning, in chat's, Responses' and Anthropic's usage; a model without one counts 0."""
    r = client.chat.completions.create(model=qwen3.name, messages=HI, max_tokens=6,
                                       temperature=0)
    assert r.usage.completion_tokens == 6
    assert r.usage.completion_tokens_details.reasoning_tokens == 6
    resp = httpx.post(f"{server}/responses", timeout=60, json={
        "model": qwen3.name, "input": HI[0]["content"], "max_output_tokens": 6,
        "temperature": 0}).json()
    assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == 6
    assert [i["type"] for i in resp["output"]][:1] == ["reasoning"]
    msg = httpx.post(f"{server.removesuffix('/v1')}/v1/messages", timeout=60, json={
        "model": qwen3.name, "max_tokens": 6, "messages": HI}).json()
    assert msg["usage"]["output_tokens"] == 6
    assert msg["usage"]["output_tokens_details"]["reasoning_tokens"] == 6
    plain = client.chat.completions.create(model=qwen3.name, messages=HI, max_tokens=6,
                                           temperature=0, reasoning_effort="none")
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0


def test_thinking_switch_changes_the_rendered_prompt(client, qwen3):
    on = client.chat.completions.create(model=qwen3.name, messages=HI, max_tokens=1)
    off = client.chat.completions.create(model=qwen3.name, messages=HI, max_tokens=1,
                                         reasoning_effort="none")
    kwargs = client.chat.completions.create(
        model=qwen3.name, messages=HI, max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens != on.usage.prompt_tokens
    assert kwargs.usage.prompt_tokens == off.usage.prompt_tokens


def test_logprobs_and_top_logprobs(client, tiny_lm):
    r = client.chat.completions.create(model=tiny_lm.name, messages=HI, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        values = [a.logprob for a in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert t.top_logprobs[0].token == t.token  # greedy takes the most likely token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5
    plain = client.chat.completions.create(model=tiny_lm.name, messages=HI, max_tokens=5)
    assert plain.choices[0].logprobs is None


def test_a_last_assistant_message_is_continued(client, tiny_lm, server):
    msgs = HI + [{"role": "assistant", "content": "The weather"}]
    r = client.chat.completions.create(model=tiny_lm.name, messages=msgs, max_tokens=5,
                                       temperature=0)
    raw = httpx.post(f"{server}/completions", timeout=60, json={
        "model": tiny_lm.name, "max_tokens": 5, "temperature": 0,
        "prompt": "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
                  "<|im_start|>assistant\nThe weather"}).json()
    assert r.choices[0].message.content == raw["choices"][0]["text"]
    assert r.usage.prompt_tokens == raw["usage"]["prompt_tokens"]


def test_model_alias_and_unknown_name(client, tiny_lm):
    r = client.chat.completions.create(model="gpt-5-codex", messages=HI, max_tokens=1)
    assert r.model == tiny_lm.name
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="claude-sonnet-4-5", messages=HI, max_tokens=1)
    assert "--model-alias" in e.value.body["message"] and tiny_lm.name in e.value.body["message"]


@pytest.mark.parametrize("model", ["tiny", "qwen3"])
def test_forced_tool_call_round_trip(client, tiny_lm, qwen3, model):
    """tool_choice 'required' makes even a random-weight model call: the call parses, names a
    given tool and matches its schema; the result goes back and the next turn answers from the
    cache."""
    lm = tiny_lm if model == "tiny" else qwen3
    extra = {"reasoning_effort": "none"} if model == "qwen3" else {}
    first = client.chat.completions.create(model=lm.name, messages=HI, tools=[WEATHER],
                                           tool_choice="required", max_tokens=200,
                                           parallel_tool_calls=False, temperature=0, **extra)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER["function"]["parameters"])
    history = HI + [{"role": "assistant", "content": choice.message.content,
                     "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    second = client.chat.completions.create(model=lm.name, messages=history, tools=[WEATHER],
                                            max_tokens=4, temperature=0, **extra)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the thinking template renders the answered turn's (empty) think block otherwise than the
    # generation prompt did: a few tokens before the answer are read again there
    slack = 1 if model == "tiny" else 8
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - slack


def test_streamed_tool_call_deltas(client, tiny_lm):
    stream = client.chat.completions.create(
        model=tiny_lm.name, messages=HI, tools=[WEATHER], max_tokens=200, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
        parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.index not in calls:  # id and name come first, then argument fragments
                    assert d.id and d.function.name == "get_weather"
                    calls[d.index] = {"args": d.function.arguments or ""}
                else:
                    assert d.id is None
                    calls[d.index]["args"] += d.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    jsonschema.validate(json.loads(calls[0]["args"]), WEATHER["function"]["parameters"])


def test_json_schema_response_format(client, tiny_lm):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "mood": {"enum": ["happy", "sad"]}},
              "required": ["name", "mood"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=tiny_lm.name, messages=HI, max_tokens=60, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    obj = client.chat.completions.create(model=tiny_lm.name, messages=HI, max_tokens=60,
                                         temperature=0,
                                         response_format={"type": "json_object"})
    text = obj.choices[0].message.content
    # a random model may write one string until the length limit: then it is cut, not wrong
    assert text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_a_tool_list_larger_than_the_context_is_a_400(client, tiny_lm):
    big = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "word " * 400,
        "parameters": {"type": "object", "properties": {}}}} for i in range(8)]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=tiny_lm.name, messages=HI, tools=big,
                                       max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    assert client.chat.completions.create(model=tiny_lm.name, messages=HI,
                                          max_tokens=1).choices  # nothing lost


def test_an_image_to_the_text_models_is_a_400_in_openais_shape(client, server, tiny_lm):
    """No served model takes images: the answer says so (streamed or not), never a 500 and
    never an answer without the image."""
    content = [{"type": "text", "text": "Compare these."},
               {"type": "image_url", "image_url": {"url": data_url(), "detail": "low"}},
               {"type": "image_url", "image_url": {"url": data_url(png(color=(1, 2, 3)))}}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=tiny_lm.name, stream=stream, messages=[
                {"role": "user", "content": content}])
        assert e.value.body["type"] == "invalid_request_error"
        assert e.value.body["code"] == "images_not_supported"
        assert "no served model takes images" in e.value.body["message"]
    r = httpx.post(f"{server}/chat/completions", json={"model": tiny_lm.name, "messages": [
        {"role": "user", "content": [{"type": "image_url",
                                      "image_url": {"url": "http://example.com/a.png"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_urls_not_allowed"
    assert "--allow-image-urls" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/chat/completions", json={"model": tiny_lm.name, "messages": [
        {"role": "system", "content": [{"type": "image_url", "image_url": {
            "url": data_url()}}]}, {"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "user and tool messages only" in r.json()["error"]["message"]


def test_sampling_fields_at_their_neutral_values_are_taken_others_are_a_400(server, tiny_lm):
    # what sglang-router 0.3.2 adds to a /v1/responses body, sent to chat completions too
    added = {"top_k": -1, "priority": 0, "min_p": 0.0, "repetition_penalty": 1.0,
             "stream": None}
    body = {"model": tiny_lm.name, "messages": HI, "temperature": 0, "max_tokens": 3}
    plain = httpx.post(f"{server}/chat/completions", json=body, timeout=60)
    taken = httpx.post(f"{server}/chat/completions", json={**body, **added}, timeout=60)
    assert plain.status_code == taken.status_code == 200, taken.text
    assert taken.json()["choices"][0]["message"]["content"] == \
        plain.json()["choices"][0]["message"]["content"]  # -1: top-k off, as 0 is
    for name, value in (("min_p", 0.1), ("repetition_penalty", 1.2), ("priority", 1),
                        ("top_k", -3)):
        r = httpx.post(f"{server}/chat/completions", json={**body, name: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
        if name != "top_k":
            assert "not supported" in r.json()["error"]["message"]
