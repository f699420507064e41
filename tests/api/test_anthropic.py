"""Anthropic's Messages API (``mlx_kvserver/api/anthropic.py``): a body translated into the one
conversation model, the stream's event sequence, and the official ``anthropic`` client against
a real server on the tiny model."""

from __future__ import annotations

import asyncio
import base64
import copy
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from mlx_kvserver.api import anthropic as am
from mlx_kvserver.api import anthropic_output as ao
from mlx_kvserver.chat.conversation import (Message, Reasoning, ResponseFormat, Text, ToolCall,
                                            ToolChoice, ToolResult)
from mlx_kvserver.chat.output import (Done, Error, Finish, ReasoningDelta, TextDelta,
                                      ToolCallDelta, ToolCallStart, Usage)
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.errors import RequestError
from harness.server_utils import running_server
from tests.chat.pictures import png

CONFIG = ServerConfig()
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                            "required": ["city"], "additionalProperties": False}}


def body(messages, **kw):
    return {"model": "m", "max_tokens": 16, "messages": messages, **kw}


def parse(**kw):
    messages = kw.pop("messages", [{"role": "user", "content": "hi"}])
    return am.parse(body(messages, **kw), CONFIG)


def rejects(b: dict, words: str, count_only: bool = False) -> RequestError:
    with pytest.raises(RequestError) as e:
        am.parse(b, CONFIG, count_only)
    assert e.value.status == 400 and words in e.value.message, e.value.message
    return e.value


# -- a body as a Conversation -----------------------------------------------------------------

def test_system_as_a_string_or_blocks_joined_by_blank_lines():
    conv = parse(system="Be brief.")
    assert conv.messages[0] == Message("system", [Text("Be brief.")])
    blocks = [{"type": "text", "text": "A"},
              {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}}]
    conv = parse(system=blocks)
    assert conv.messages[0] == Message("system", [Text("A\n\nB")])
    assert conv.messages[1] == Message("user", [Text("hi")])
    assert [m.role for m in parse(system=[]).messages] == ["user"]


def test_text_blocks_of_a_message_are_paragraphs_not_glued():
    """Claude Code sends a <system-reminder> block and the prompt as two blocks."""
    conv = parse(messages=[{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>be careful</system-reminder>"},
        {"type": "text", "text": "fix the bug", "cache_control": {"type": "ephemeral"}}]}])
    assert conv.messages[-1] == Message(
        "user", [Text("<system-reminder>be careful</system-reminder>\n\nfix the bug")])


def test_a_system_message_inside_messages_stays_where_it_is():
    conv = parse(system="top", messages=[
        {"role": "user", "content": "one"},
        {"role": "system", "content": [{"type": "text", "text": "x"},
                                       {"type": "text", "text": "y"}]},
        {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}])
    assert [(m.role, m.text) for m in conv.messages] == [
        ("system", "top"), ("user", "one"), ("system", "x\n\ny"), ("assistant", "two"),
        ("user", "three")]


def test_every_block_kind():
    conv = parse(messages=[
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "ask the tool", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
             "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "data"}]},
            {"type": "text", "text": "and now?"}], "message_id": "u2"}],
        tools=[WEATHER])
    assert conv.messages == [
        Message("user", [Text("weather?")]),
        Message("assistant", [Reasoning("ask the tool"), Text("Checking."),
                              ToolCall("toolu_1", "get_weather", '{"city": "Paris"}'),
                              ToolCall("toolu_2", "get_weather", '{"city": "Oslo"}')]),
        Message("tool", [ToolResult("toolu_1", "sunny", "get_weather")]),
        Message("tool", [ToolResult("toolu_2", "no\n\ndata", "get_weather", True)]),
        Message("user", [Text("and now?")], "u2")]
    assert conv.tools[0].name == "get_weather" and conv.tools[0].parameters == \
        WEATHER["input_schema"]
    assert not conv.continue_final and conv.n == 1


def test_message_ids_sampling_and_unknown_fields():
    conv = parse(messages=[{"role": "user", "content": "a", "message_id": "m1"},
                           {"role": "assistant", "content": "b", "message_id": "m2"},
                           {"role": "user", "content": "c"}],
                 temperature=0.5, top_p=0.9, top_k=5, stop_sequences=["END"], stream=True,
                 some_future_beta={"x": 1}, service_tier="auto", container="c1")
    assert [m.message_id for m in conv.messages] == ["m1", "m2", None]
    s = conv.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stop) == (16, 0.5, 0.9, 5, ["END"])
    assert conv.stream and conv.model == "m"
    assert parse().sampling.temperature == CONFIG.temperature  # absent: the server's default


def test_fields_that_do_not_reach_the_model_change_nothing():
    """Invariant 9: cache_control moves between turns, metadata and context management vary:
    the Conversation (and so the prompt) is the same."""
    def make(marked: int, **extra):
        msgs = [{"role": "user", "content": [{"type": "text", "text": "one"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "two"}]},
                {"role": "user", "content": [{"type": "text", "text": "three"}]}]
        msgs[marked]["content"][0]["cache_control"] = {"type": "ephemeral"}
        system = [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}]
        tools = [dict(WEATHER, cache_control={"type": "ephemeral"})] if marked else [WEATHER]
        return am.parse(body(msgs, system=system, tools=tools, **extra), CONFIG)
    a = make(0)
    b = make(2, metadata={"user_id": json.dumps({"session": "s"})},
             context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
             output_config={"effort": "high"}, service_tier="standard_only")
    assert a == b


def test_prefill_continues_the_last_assistant_message():
    conv = parse(messages=[{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "Sure:"}])
    assert conv.continue_final and conv.messages[-1] == Message("assistant", [Text("Sure:")])
    rejects(body([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}],
        tools=[WEATHER]), "tool_result")


def test_tool_choice_mapping():
    def choice(raw):
        conv = parse(tools=[WEATHER], tool_choice=raw)
        return conv.tool_choice, conv.parallel_tool_calls
    assert choice(None) == (ToolChoice("auto"), True)
    assert choice({"type": "auto"}) == (ToolChoice("auto"), True)
    assert choice({"type": "any"}) == (ToolChoice("required"), True)
    assert choice({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}) \
        == (ToolChoice("function", "get_weather"), False)
    assert choice({"type": "none"}) == (ToolChoice("none"), True)
    for bad in ({"type": "tool", "name": "other"}, {"type": "tool"}, {"type": "sometimes"},
                "auto"):
        with pytest.raises(RequestError):
            choice(bad)
    rejects(body([{"role": "user", "content": "hi"}], tool_choice={"type": "any"}),
            "'tools' is empty")


def test_thinking_and_output_config():
    assert parse().thinking is None
    assert parse(thinking={"type": "enabled", "budget_tokens": 2048}).thinking is True
    assert parse(thinking={"type": "disabled"}).thinking is False
    assert parse(thinking={"type": "adaptive"}).thinking is None
    schema = {"type": "object", "properties": {"title": {"type": "string"}}}
    conv = parse(output_config={"effort": "high",
                                "format": {"type": "json_schema", "schema": schema}})
    assert conv.response_format == ResponseFormat("json_schema", schema)
    assert parse(output_format={"type": "json_schema", "schema": schema}).response_format == \
        ResponseFormat("json_schema", schema)
    assert parse(output_config={"effort": "low"}).response_format == ResponseFormat()
    rejects(body([{"role": "user", "content": "x"}], thinking={"type": "sometimes"}),
            "thinking.type")
    rejects(body([{"role": "user", "content": "x"}],
                 output_config={"format": {"type": "json_schema", "schema": {"type": 7}}}),
            "not valid JSON Schema")


@pytest.mark.parametrize("change,words", [
    ({"tools": {"name": "x"}}, "'tools' must be a list"),
    ({"tools": [{"name": "x", "input_schema": {"type": "objekt"}}]}, "not valid JSON Schema"),
    ({"tools": [{"name": "x"}]}, "input_schema is required"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"messages": []}, "non-empty"),
    ({"max_tokens": None}, "'max_tokens' is required"),
    ({"model": None}, "'model' is required"),
    ({"temperature": 1.5}, "between 0 and 1"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user"}]}, "content is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/tiff", "data": "AA=="}}]}]}, "media_type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "not base64!"}}]}]}, "base64"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "file", "file_id": "f"}}]}]}, "files are not served"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image", "source": {
        "type": "url", "url": "https://example.com/a.png"}}]}]}, "not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "document blocks are not served"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]}, "'nope'"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]},
     "source must be"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]}, "not supported"),
    ({"messages": [{"role": "user", "content": "x", "message_id": ""}]}, "message_id"),
])
def test_bad_input_is_a_400(change, words):
    b = body([{"role": "user", "content": "hi"}])
    b.update(change)
    rejects(b, words)


def test_count_tokens_body_needs_no_max_tokens():
    b = body([{"role": "user", "content": "hi"}])
    del b["max_tokens"]
    assert am.parse(b, CONFIG, count_only=True).sampling.max_tokens is None


# -- the stream's events, from the engine's events --------------------------------------------

class _Watch:
    def event(self, event): pass
    def close(self): pass


class _Job:
    def __init__(self, events):
        self.events = asyncio.Queue()
        for e in events:
            self.events.put_nowait(e)

    def cancel(self): pass


def _run_stream(events) -> list[tuple[str, dict]]:
    async def go():
        job = _Job(events)
        return [s async for s in ao.stream(job, _Watch(), "msg_1", "claude-x",
                                            Usage(10, 0, 4))]
    out = []
    for s in asyncio.run(go()):
        head, data = s.rstrip("\n").split("\n")
        kind = head.removeprefix("event: ")
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == kind or (kind == "error" and payload["type"] == "error")
        out.append((kind, payload))
    return out


def test_stream_event_sequence_closes_each_block_in_order():
    events = [ReasoningDelta(0, "hmm"), ReasoningDelta(0, " ok"),
              TextDelta(0, "Let me"), TextDelta(0, " check."),
              ToolCallStart(0, 0, "call_1", "get_weather"),
              ToolCallDelta(0, 0, '{"city": "Paris"}'),
              Finish(0, "tool_calls", "msg_1", "Let me check.", "hmm ok",
                     (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
              Usage(10, 7, 4), Done()]
    out = _run_stream(events)
    kinds = [k if k != "content_block_delta" else p["delta"]["type"] for k, p in out]
    assert kinds == [
        "message_start", "ping",
        "content_block_start", "thinking_delta", "thinking_delta", "signature_delta",
        "content_block_stop",
        "content_block_start", "text_delta", "text_delta", "content_block_stop",
        "content_block_start", "input_json_delta", "content_block_stop",
        "message_delta", "message_stop"]
    start = out[0][1]["message"]
    assert start["id"] == "msg_1" and start["model"] == "claude-x" and start["content"] == []
    assert start["usage"] == {"input_tokens": 6, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 4, "output_tokens": 0,
                              "output_tokens_details": {"reasoning_tokens": 0,
                                                        "accepted_prediction_tokens": 0,
                                                        "rejected_prediction_tokens": 0,
                                                        "accepted_draft_tokens": 0,
                                                        "rejected_draft_tokens": 0},
                              "decode_steps": 0}
    blocks = [p for k, p in out if k == "content_block_start"]
    assert [b["index"] for b in blocks] == [0, 1, 2]
    assert blocks[2]["content_block"] == {"type": "tool_use", "id": "call_1",
                                          "name": "get_weather", "input": {}}
    assert out[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert out[-2][1]["usage"]["output_tokens"] == 7


def test_stream_error_mid_answer_is_an_error_event():
    out = _run_stream([TextDelta(0, "partial"),
                       Error(RequestError(500, "the worker died", type="server_error")),
                       Done()])
    assert [k for k, _ in out][-1] == "error"
    assert out[-1][1] == {"type": "error", "error": {"type": "api_error",
                                                     "message": "the worker died"}}
    assert "message_stop" not in [k for k, _ in out]


def test_stop_reasons():
    def reason(f):
        return ao.message_body("msg_1", "m", f, Usage(3, 1, 0))["stop_reason"]
    assert reason(Finish(0, "stop", "msg_1", "x")) == "end_turn"
    assert reason(Finish(0, "length", "msg_1", "x")) == "max_tokens"
    assert reason(Finish(0, "tool_calls", "msg_1", "")) == "tool_use"
    f = Finish(0, "stop", "msg_1", "x", stop_sequence="END")
    assert ao.message_body("msg_1", "m", f, Usage(3, 1, 0))["stop_sequence"] == "END"
    assert reason(f) == "stop_sequence"


# -- live, through the official client ----------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_lm, tmp_path_factory):
    config = ServerConfig(kv_cache_dir=tmp_path_factory.mktemp("kv"), max_tokens=16)
    with running_server([tiny_lm], config) as url:
        yield url.removesuffix("/v1")


@pytest.fixture()
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)


LONG = ("The capital of France is Paris. Hello world, hello there! How are you today? "
        "the quick brown fox jumps over the lazy dog 0123456789. ") * 3


def test_non_streaming_message(client, tiny_lm):
    r = client.messages.create(model=tiny_lm.name, max_tokens=8, system="Be brief.",
                               messages=[{"role": "user", "content": "hello there"}])
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert r.model == tiny_lm.name
    assert [b.type for b in r.content] in (["text"], [])
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 8
    assert u.cache_creation_input_tokens == 0 and u.cache_read_input_tokens >= 0


def test_stream_events_match_the_non_streaming_answer(client, server, tiny_lm):
    kw = dict(model=tiny_lm.name, max_tokens=8,
              messages=[{"role": "user", "content": "stream me please"}])
    full = client.messages.create(**kw)
    events = list(client.messages.create(stream=True, **kw))
    types = [e.type for e in events]  # (the client drops ping events)
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types[1:-2] == (["content_block_start"] + ["content_block_delta"] * (len(types) - 5)
                           + ["content_block_stop"] if len(types) > 3 else [])
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == "".join(b.text for b in full.content)
    assert events[-2].delta.stop_reason == full.stop_reason
    assert events[-2].usage.output_tokens == full.usage.output_tokens
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and [b.model_dump(include={"type", "text"}) for b in final.content] \
        == [b.model_dump(include={"type", "text"}) for b in full.content]
    assert final.stop_reason == full.stop_reason and final.id != full.id
    with httpx.stream("POST", f"{server}/v1/messages", json={**kw, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[:3:2] == ["event: message_start", "event: ping"]
    for head, data in zip(lines[::2], lines[1::2]):
        assert head.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == head[7:]


def test_errors_in_anthropics_shape(client, server, tiny_lm):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=tiny_lm.name, max_tokens=8, messages=[
            {"role": "user", "content": [IMAGE, {"type": "text", "text": "What is it?"}]}])
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "no served model takes images" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=tiny_lm.name, max_tokens=8, stream=True,
                               messages=[{"role": "user", "content": "x"}],
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    r = httpx.post(f"{server}/v1/messages", json={"model": tiny_lm.name, "messages": [
        {"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=8,
                               messages=[{"role": "user", "content": "x"}])


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                    "data": base64.b64encode(png()).decode()}}


def test_images_to_the_text_model_are_a_400_in_anthropics_shape(client, server, tiny_lm):
    """In a user message, in a tool result, by URL, and counted: never a 500, never dropped."""
    ask = [{"role": "user", "content": "Take a screenshot."},
           {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                              "name": "screenshot", "input": {}}]},
           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                         "content": [{"type": "text", "text": "done"},
                                                     IMAGE]}]}]
    for messages in ([{"role": "user", "content": [IMAGE, IMAGE]}], ask):
        for call in (client.messages.create, client.messages.count_tokens):
            extra = {"max_tokens": 8} if call == client.messages.create else {}
            with pytest.raises(anthropic.BadRequestError) as e:
                call(model=tiny_lm.name, messages=messages, **extra)
            assert e.value.body["error"]["type"] == "invalid_request_error"
            assert "no served model takes images" in e.value.body["error"]["message"]
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    r = httpx.post(f"{server}/v1/messages", json={"model": tiny_lm.name, "max_tokens": 8,
                                                  "messages": [{"role": "user",
                                                                "content": [url]}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "--allow-image-urls" in r.json()["error"]["message"]


def test_turn_two_reads_the_cache_and_count_tokens_agrees(client, tiny_lm):
    first = [{"role": "user", "content": LONG}]
    r1 = client.messages.create(model=tiny_lm.name, max_tokens=8, system="Be brief.",
                                messages=first)
    answer = "".join(b.text for b in r1.content)
    assert r1.usage.input_tokens + r1.usage.cache_read_input_tokens > 32
    for ids in (True, False):  # by the answer's message_id, or by the prompt's own content
        second = first + [{"role": "assistant", "content": answer,
                           **({"message_id": r1.id} if ids else {})},
                          {"role": "user", "content": "and then?" if ids else "more?"}]
        r2 = client.messages.create(model=tiny_lm.name, max_tokens=8, system="Be brief.",
                                    messages=second)
        u = r2.usage
        assert u.cache_read_input_tokens > 0, u
        n = client.messages.count_tokens(model=tiny_lm.name, system="Be brief.",
                                         messages=second).input_tokens
        assert n == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert r2.usage.cache_read_input_tokens >= 32


def test_prefill_continues_like_chat_completions(client, server, tiny_lm):
    history = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital"}]
    r = client.messages.create(model=tiny_lm.name, max_tokens=8, messages=history)
    chat = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    c = chat.chat.completions.create(model=tiny_lm.name, max_tokens=8, temperature=0,
                                     messages=history)
    text = "".join(b.text for b in r.content)
    assert text == c.choices[0].message.content and not text.startswith("The capital")
    n = client.messages.count_tokens(model=tiny_lm.name, messages=history).input_tokens
    assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens == c.usage.prompt_tokens


def test_greedy_answer_equals_chat_completions(client, server, tiny_lm):
    system, msgs = "You are a helpful assistant.", [{"role": "user", "content": "hello world"}]
    r = client.messages.create(model=tiny_lm.name, max_tokens=12, system=system, messages=msgs,
                               extra_body={"temperature": 0})  # (not a parameter in this SDK)
    chat = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    c = chat.chat.completions.create(model=tiny_lm.name, max_tokens=12, temperature=0,
                                     messages=[{"role": "system", "content": system}, *msgs])
    assert "".join(b.text for b in r.content) == c.choices[0].message.content
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == c.usage.prompt_tokens


def test_claude_code_like_request(server, tiny_lm):
    """``?beta=true``, Claude Code's headers, system blocks with cache_control, a system
    message in the middle, adaptive thinking, context management, metadata: all accepted."""
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "k", "x-app": "cli",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                 "context-management-2025-06-27",
               "X-Claude-Code-Session-Id": "0f0e"}
    b = {"model": tiny_lm.name, "max_tokens": 32000, "stream": True,
         "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0.abc;"},
                    {"type": "text", "text": "You are a coding agent.",
                     "cache_control": {"type": "ephemeral"}}],
         "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]},
                      {"role": "system", "content": "Remember the rules."},
                      {"role": "user", "content": [{"type": "text", "text": "hi",
                                                    "cache_control": {"type": "ephemeral"}}]}],
         "tools": [WEATHER], "thinking": {"type": "adaptive"},
         "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
         "output_config": {"effort": "high"},
         "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})}}
    with httpx.stream("POST", f"{server}/v1/messages?beta=true", json=b, headers=headers,
                      timeout=60) as r:
        assert r.status_code == 200
        kinds = [ln[7:] for ln in r.iter_lines() if ln.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    count = httpx.post(f"{server}/v1/messages/count_tokens?beta=true", headers=headers,
                       json={k: v for k, v in b.items() if k not in ("max_tokens", "stream")})
    assert count.status_code == 200 and count.json()["input_tokens"] > 0
    client = anthropic.Anthropic(base_url=server, api_key="k", max_retries=0)
    m = client.beta.messages.create(model=tiny_lm.name, max_tokens=4, betas=[
        "context-management-2025-06-27"], messages=[{"role": "user", "content": "hi"}])
    assert m.type == "message"


def test_tool_round_trip(client, tiny_lm):
    """tool_choice any is grammar-constrained: the tiny random model must call the tool with
    input that matches its schema; then the result goes back and a text answer follows.
    (Parallel calls are off: a random model never stops adding calls otherwise.)"""
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.messages.create(model=tiny_lm.name, max_tokens=200, tools=[WEATHER],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               messages=history)
    assert r.stop_reason == "tool_use", r
    calls = [b for b in r.content if b.type == "tool_use"]
    assert [b.type for b in r.content] == ["tool_use"] and calls[0].name == "get_weather"
    for c in calls:
        jsonschema.validate(c.input, WEATHER["input_schema"])
    with client.messages.stream(model=tiny_lm.name, max_tokens=200, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True},
                                messages=history) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [c.input for c in final.content if c.type == "tool_use"] == [c.input for c in calls]
    history += [{"role": "assistant", "content": [b.model_dump() for b in r.content],
                 "message_id": r.id},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id,
                                              "content": "sunny, 21 C"} for c in calls]}]
    r2 = client.messages.create(model=tiny_lm.name, max_tokens=8, tools=[WEATHER],
                                tool_choice={"type": "none"}, messages=history)
    assert r2.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in r2.content)
    assert r2.usage.cache_read_input_tokens > 0
    bad = copy.deepcopy(history)
    bad[-1]["content"][0]["tool_use_id"] = "toolu_unknown"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=tiny_lm.name, max_tokens=8, tools=[WEATHER],
                               messages=bad)


def test_thinking_blocks_stream_and_come_back(tmp_path, tmp_path_factory):
    """A template whose generation prompt opens a think block (Qwen3.5-style): the random
    model's output is reasoning, which comes back as a thinking block (signature ""), streamed
    as thinking_delta then signature_delta; sent back on the next turn, it is accepted."""
    from mlx_kvserver.models.loading import resolve_and_load
    from tests.chat.templates import QWEN3_STRICT
    from harness.tiny_model import make_tiny_model_dir

    lm = resolve_and_load(str(make_tiny_model_dir(tmp_path / "thinker",
                                                  chat_template=QWEN3_STRICT)))
    config = ServerConfig(kv_cache_dir=tmp_path_factory.mktemp("kv"), max_tokens=16)
    with running_server([lm], config) as url:
        client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="k",
                                     max_retries=0)
        kw = dict(model=lm.name, max_tokens=8,
                  thinking={"type": "enabled", "budget_tokens": 1024},
                  messages=[{"role": "user", "content": "hello there"}])
        r = client.messages.create(**kw)
        assert r.content[0].type == "thinking" and r.content[0].thinking
        assert r.content[0].signature == ""
        events = list(client.messages.create(stream=True, **kw))
        deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
        assert deltas[0] == "thinking_delta" and "signature_delta" in deltas
        with client.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert final.content[0].model_dump() == r.content[0].model_dump()
        r2 = client.messages.create(**{**kw, "messages": kw["messages"] + [
            {"role": "assistant", "content": [b.model_dump() for b in r.content]},
            {"role": "user", "content": "go on"}]})
        def total(u):
            return u.input_tokens + u.cache_read_input_tokens
        assert total(r2.usage) > total(r.usage)
