"""``/v1/responses``: the translation into the conversation model, the response object and its
stream (on a scripted engine, through the official ``openai`` client), and live on a real
server with the tiny model (previous_response_id, a restart, tools, chat parity)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route
from starlette.testclient import TestClient

from mlx_kvserver.api import openai_chat, responses
from mlx_kvserver.api.http import error_responder
from mlx_kvserver.chat.conversation import (Message, Reasoning, Text, ToolCall, ToolChoice,
                                            ToolResult)
from mlx_kvserver.chat.output import (Done, Error, Finish, ReasoningDelta, Start, TextDelta,
                                      ToolCallDelta, ToolCallStart, Usage)
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.errors import RequestError
from mlx_kvserver.storage.responses import ResponseStore
from tests.chat.pictures import data_url

CONFIG = ServerConfig()
PARAMS = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}


def codex_body(ids: bool = True) -> dict:
    """A request shaped as Codex CLI's (DESIGN.md, 'What real agents send'), turn 2."""
    def i(prefix):
        return {"id": f"{prefix}_{time.monotonic_ns()}"} if ids else {}
    return {
        "model": "m", "stream": True, "store": False, "tool_choice": "auto",
        "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "session-1",
        "tools": [{"type": "function", "name": "shell", "description": "run", "strict": False,
                   "parameters": PARAMS},
                  {"type": "function", "name": "update_plan", "strict": False,
                   "parameters": {"type": "object", "properties": {}}},
                  {"type": "namespace", "name": "mcp__docs__", "description": "docs server",
                   "tools": [{"type": "function", "name": "search", "parameters": PARAMS},
                             {"type": "function", "name": "fetch"}]},
                  {"type": "web_search", "external_web_access": False}],
        "input": [
            {"type": "message", "role": "developer", **i("msg"),
             "content": [{"type": "input_text", "text": "<permissions>sandboxed</permissions>"}]},
            {"type": "message", "role": "developer", **i("msg"),
             "content": [{"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "user", **i("msg"),
             "content": [{"type": "input_text", "text": "<environment_context>cwd=/w"
                                                        "</environment_context>"}]},
            {"type": "message", "role": "user", **i("msg"),
             "content": [{"type": "input_text", "text": "list the files"}]},
            {"type": "reasoning", **i("rs"), "summary": [{"type": "summary_text",
                                                          "text": "I should run ls."}],
             "encrypted_content": None},
            {"type": "function_call", **i("fc"), "call_id": "call_1", "name": "shell",
             "arguments": '{"cmd": "ls"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
            {"type": "function_call", **i("fc"), "call_id": "call_2", "name": "search",
             "namespace": "mcp__docs__", "arguments": '{"cmd": "x"}'},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "found"}]},
            {"type": "message", "role": "assistant", **i("msg"),
             "content": [{"type": "output_text", "text": "Two files.", "annotations": []}]},
            {"type": "message", "role": "user", **i("msg"),
             "content": [{"type": "input_text", "text": "thanks"}]}]}


# -- translation ----------------------------------------------------------------------------------

def test_string_input_and_instructions_first():
    conv = responses.parse({"input": "hi", "instructions": "be brief"}, CONFIG)
    assert conv.messages == [Message("system", [Text("be brief")]), Message("user", [Text("hi")])]
    assert conv.sampling.max_tokens == CONFIG.max_tokens and not conv.stream


def test_message_shapes_roles_and_parts():
    conv = responses.parse({"input": [
        {"role": "system", "content": "s"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
        {"role": "user", "content": "e"}]}, CONFIG)
    assert [(m.role, m.text) for m in conv.messages] == [
        ("system", "s"), ("developer", "d"), ("user", "ab"), ("assistant", "c"), ("user", "e")]


def test_codex_body_tools_namespaces_and_hosted_tools():
    conv = responses.parse(codex_body(), CONFIG)
    assert [t.name for t in conv.tools] == ["shell", "update_plan", "mcp__docs__search",
                                            "mcp__docs__fetch"]  # web_search is not offered
    assert conv.stream and conv.tool_choice == ToolChoice("auto") and conv.parallel_tool_calls
    assert conv.thinking is None
    roles = [m.role for m in conv.messages]
    assert roles == ["developer", "developer", "user", "user", "assistant", "tool", "assistant",
                     "tool", "assistant", "user"]
    a = conv.messages[4]
    assert a.parts == [Reasoning("I should run ls."), ToolCall("call_1", "shell", '{"cmd": "ls"}')]
    assert conv.messages[6].parts == [ToolCall("call_2", "mcp__docs__search", '{"cmd": "x"}')]
    assert conv.messages[7].parts == [ToolResult("call_2", "found")]
    assert responses.namespaces(codex_body()["tools"]) == {
        "mcp__docs__search": ("mcp__docs__", "search"),
        "mcp__docs__fetch": ("mcp__docs__", "fetch")}
    assert responses.flat_name("crm", "find") == "crm.find"


def test_item_ids_never_change_the_conversation():
    """Invariant 9: two bodies that differ only in item ids give equal conversations."""
    a, b = codex_body(ids=True), codex_body(ids=True)
    assert a != b
    assert responses.parse(a, CONFIG) == responses.parse(b, CONFIG) == \
        responses.parse(codex_body(ids=False), CONFIG)


def test_same_history_as_chat_completions_gives_the_same_messages():
    chat = openai_chat.parse({"messages": [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me look", "reasoning_content": "think",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "shell", "arguments": '{"cmd": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
        {"role": "user", "content": "ok"}]}, CONFIG)
    resp = responses.parse({"instructions": "sys", "input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                          "text": "think"}]},
        {"role": "assistant", "content": "let me look"},
        {"type": "function_call", "call_id": "c1", "name": "shell",
         "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "out"},
        {"role": "user", "content": "ok"}]}, CONFIG)
    assert resp.messages == chat.messages


def test_options_format_reasoning_and_limits():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    conv = responses.parse({
        "input": "x", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "text": {"format": {"type": "json_schema", "name": "s", "schema": schema,
                            "strict": True}},
        "reasoning": {"effort": "high", "summary": "auto"}, "parallel_tool_calls": False,
        "tools": [{"type": "namespace", "name": "crm", "description": "",
                   "tools": [{"type": "function", "name": "find"}]}],
        "tool_choice": {"type": "function", "name": "find", "namespace": "crm"},
        "metadata": {"k": "v"}, "truncation": "auto", "user": "u", "service_tier": "auto",
        "include": ["message.output_text.logprobs"], "top_logprobs": 2}, CONFIG)
    assert conv.sampling.max_tokens == 7 and conv.sampling.temperature == 0.5
    assert conv.sampling.top_p == 0.9 and conv.sampling.logprobs
    assert conv.sampling.top_logprobs == 2
    assert conv.response_format.type == "json_schema" and conv.response_format.schema == schema
    assert conv.thinking is True and not conv.parallel_tool_calls
    assert conv.tool_choice == ToolChoice("function", "crm.find")
    assert responses.parse({"input": "x", "reasoning": {"effort": "minimal"}},
                           CONFIG).thinking is False
    assert responses.parse({"input": "x", "text": {"format": {"type": "json_object"}}},
                           CONFIG).response_format.type == "json_object"


def test_encrypted_only_reasoning_is_dropped():
    conv = responses.parse({"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA..."},
        {"role": "assistant", "content": "a"}, {"role": "user", "content": "r"}]}, CONFIG)
    assert conv.messages[1].parts == [Text("a")]


BAD = [
    ({"input": "x", "tools": {"type": "function", "name": "f"}}, "tools"),
    ({"input": "x", "tools": [{"type": "function", "name": "f",
                               "parameters": {"type": "nonsense"}}]}, "tools[0]"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                        "schema": {"type": 5}}}}, "text.format.schema"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "input"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image",
                                                   "image_url": "data:image/png;base64,AA=="}]}]},
     "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": "q"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
     "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "instructions": ["x"]}, "instructions"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_input_is_a_400_naming_the_field(body, param):
    with pytest.raises(RequestError) as e:
        responses.parse(body, CONFIG)
    assert e.value.status == 400 and e.value.param == param


# -- the response object and stream, on a scripted engine ------------------------------------------

class FakeServed:
    """``App``'s surface for this module: ``config``, ``responses``, ``start``; each answer is
    the next script of engine events."""

    def __init__(self, scripts):
        self.config, self.responses = CONFIG, ResponseStore(None)
        self.scripts, self.convs, self.ids = list(scripts), [], []

    async def start(self, request, conv, job_id=None, answer_ids=None):
        self.convs.append(conv)
        self.ids.append((job_id, answer_ids))
        events = asyncio.Queue()
        for ev in self.scripts.pop(0):
            events.put_nowait(ev)
        events.put_nowait(Done())
        job = SimpleNamespace(id=job_id, created=123, lm=SimpleNamespace(name="tiny"),
                              events=events, cancel=lambda: None)
        watch = SimpleNamespace(event=lambda e: None, close=lambda: None)
        return job, SimpleNamespace(prompt_tokens=10, cached_tokens=4), watch


def fake_client(served):
    async def post(request: Request):
        try:
            return await responses.handle(served, request)
        except RequestError as e:
            return error_responder(request.url.path)(e)

    async def by_id(request: Request):
        try:
            return await responses.handle_id(served, request)
        except RequestError as e:
            return error_responder(request.url.path)(e)
    app = Starlette(routes=[Route("/v1/responses", post, methods=["POST"]),
                            Route("/v1/responses/{response_id:path}", by_id,
                                  methods=["GET", "DELETE"])])
    http = TestClient(app)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0), http


def tool_script(text="Let me check.", reason="tool_calls"):
    call = ToolCall("call_9", "mcp__docs__search", '{"cmd": "ls"}')
    return [Start(0, "x"), ReasoningDelta(0, "Think"), ReasoningDelta(0, "ing."),
            TextDelta(0, text[:4]), TextDelta(0, text[4:]),
            ToolCallStart(0, 0, "call_9", "mcp__docs__search"),
            ToolCallDelta(0, 0, '{"cmd": '), ToolCallDelta(0, 0, '"ls"}'),
            Finish(0, reason, "x", text, "Thinking.", (call,)), Usage(10, 6, 4)]


def text_script(text="Hello!", reason="stop"):
    return [Start(0, "x"), TextDelta(0, text), Finish(0, reason, "x", text), Usage(10, 2, 4)]


def test_response_object_parses_in_the_official_client():
    served = FakeServed([tool_script()])
    client, _ = fake_client(served)
    r = client.responses.create(model="tiny", input="q", tools=codex_body()["tools"],
                                instructions="sys", metadata={"a": "b"})
    rid = r.id
    assert rid.startswith("resp_") and served.ids == [(rid, [rid])]
    assert r.object == "response" and r.status == "completed" and r.model == "tiny"
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    rs, msg, fc = r.output
    assert rs.summary[0].text == "Thinking." and rs.content[0].text == "Thinking."
    assert msg.role == "assistant" and msg.content[0].text == "Let me check."
    assert msg.id.startswith("msg_") and msg.status == "completed"
    assert (fc.name, fc.namespace, fc.call_id, fc.arguments, fc.status) == (
        "search", "mcp__docs__", "call_9", '{"cmd": "ls"}', "completed")
    assert r.output_text == "Let me check."
    assert r.usage.input_tokens == 10 and r.usage.output_tokens == 6
    assert r.usage.input_tokens_details.cached_tokens == 4 and r.usage.total_tokens == 16
    assert r.instructions == "sys" and r.metadata == {"a": "b"} and r.store is True
    assert r.parallel_tool_calls and r.tool_choice == "auto" and len(r.tools) == 4
    assert client.responses.retrieve(rid).output[2].namespace == "mcp__docs__"


def test_stream_event_sequence():
    served = FakeServed([tool_script()])
    client, http = fake_client(served)
    events = list(client.responses.create(model="tiny", input="q", stream=True,
                                          tools=codex_body()["tools"]))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1, 2]
    assert events[2].item.type == "reasoning" and events[16].item.name == "search"
    assert events[16].item.namespace == "mcp__docs__" and events[16].item.arguments == ""
    assert events[19].arguments == '{"cmd": "ls"}'
    done = events[-1].response
    assert done.status == "completed" and done.output_text == "Let me check."
    assert done.model_dump() == client.responses.retrieve(done.id).model_dump()
    served.scripts.append(tool_script())
    with client.responses.stream(model="tiny", input="q", tools=codex_body()["tools"]) as s:
        kinds = [e.type for e in s]  # the client's own accumulator follows the events
        final = s.get_final_response()
    assert kinds[-1] == "response.completed" and final.output_text == "Let me check."
    assert final.output[2].arguments == '{"cmd": "ls"}'
    served.scripts.append(text_script())
    with http.stream("POST", "/v1/responses", json={"input": "x", "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    for block in blocks:  # 'event:' names the type; no [DONE] in this API
        event, data = block.split("\n")
        assert event.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]


def test_previous_response_id_continues_the_stored_history():
    served = FakeServed([tool_script(), text_script("Done."), text_script("Bye.")])
    client, http = fake_client(served)
    r1 = client.responses.create(model="tiny", input="q", instructions="sys",
                                 tools=codex_body()["tools"])
    r2 = client.responses.create(model="tiny", previous_response_id=r1.id,
                                 tools=codex_body()["tools"], input=[
                                     {"type": "function_call_output", "call_id": "call_9",
                                      "output": "result"}])
    conv = served.convs[1]
    assert conv.messages == [  # no instructions: they are not part of the stored history
        Message("user", [Text("q")]),
        Message("assistant", [Reasoning("Thinking."), Text("Let me check."),
                              ToolCall("call_9", "mcp__docs__search", '{"cmd": "ls"}')], r1.id),
        Message("tool", [ToolResult("call_9", "result")])]
    assert r2.previous_response_id == r1.id and r2.output_text == "Done."
    client.responses.create(model="tiny", previous_response_id=r2.id, input="more",
                            instructions="new sys", store=False)
    assert served.convs[2].messages == [Message("system", [Text("new sys")])] + \
        conv.messages + [Message("assistant", [Text("Done.")], r2.id),
                         Message("user", [Text("more")])]
    assert len(served.responses) == 2  # store=False kept nothing
    missing = http.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_no"})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "previous_response_not_found"
    assert missing.json()["error"]["param"] == "previous_response_id"


def test_get_and_delete():
    served = FakeServed([text_script()])
    client, http = fake_client(served)
    r = client.responses.create(model="tiny", input="q")
    assert client.responses.retrieve(r.id).output_text == "Hello!"
    deleted = http.delete(f"/v1/responses/{r.id}")
    assert deleted.json() == {"id": r.id, "object": "response", "deleted": True}
    for method in ("GET", "DELETE"):
        gone = http.request(method, f"/v1/responses/{r.id}")
        assert gone.status_code == 404 and gone.json()["error"]["type"] == \
            "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("../../etc/passwd")


def test_length_is_incomplete_and_errors_fail():
    served = FakeServed([text_script("abc", "length"), text_script("abc", "length"),
                         [Start(0, "x"), TextDelta(0, "ab"),
                          Error(RequestError(500, "boom", type="server_error"))],
                         [Start(0, "x"), Error(RequestError(500, "boom", type="server_error"))]])
    client, http = fake_client(served)
    r = client.responses.create(model="tiny", input="q", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.max_output_tokens == 3
    events = list(client.responses.create(model="tiny", input="q", stream=True))
    assert events[-1].type == "response.incomplete"
    events = list(client.responses.create(model="tiny", input="q", stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "server_error"
    assert events[-1].response.error.message == "boom"
    failed = http.post("/v1/responses", json={"input": "q"})
    assert failed.status_code == 500 and failed.json()["error"]["message"] == "boom"


def test_empty_answer_still_has_a_message_item():
    served = FakeServed([[Start(0, "x"), Finish(0, "stop", "x", ""), Usage(3, 1, 0)]])
    client, _ = fake_client(served)
    r = client.responses.create(model="tiny", input="q")
    assert [o.type for o in r.output] == ["message"] and r.output_text == ""


# -- live, on a real server with the tiny model ----------------------------------------------------

def _live(url):
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def live(tiny_lm, tmp_path_factory):
    from harness.server_utils import running_server

    cache = tmp_path_factory.mktemp("responses-cache")
    config = ServerConfig(max_tokens=8, page_size=8, kv_cache_dir=cache)
    with running_server([tiny_lm], config) as url:
        yield SimpleNamespace(url=url, cache=cache, config=config)


LONG = "Tell me about the sea and the mountains, and which is older. " * 4


def test_live_create_stream_retrieve_delete(live, tiny_lm):
    client = _live(live.url)
    r = client.responses.create(model=tiny_lm.name, input="hello there", temperature=0)
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    events = list(client.responses.create(model=tiny_lm.name, input="hello there", stream=True,
                                          temperature=0))
    assert events[0].type == "response.created" and events[-1].response.output_text == \
        r.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        r.output_text
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    bad = httpx.post(f"{live.url}/responses", json={"input": "x", "tools": "shell"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
    missing = httpx.post(f"{live.url}/responses",
                         json={"input": "x", "previous_response_id": "resp_unknown"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == \
        "previous_response_not_found"


def test_live_a_prompt_past_the_context_names_the_input(live, tiny_lm):
    """The engine's refusal of a prompt that cannot fit names the field a Responses client
    shortens (``input``), as chat completions name ``messages``."""
    words = "word " * (tiny_lm.context_length + 10)
    r = httpx.post(f"{live.url}/responses", json={"input": words}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "input"
    chat = httpx.post(f"{live.url}/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": words}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"


def test_live_previous_response_id_uses_the_cache_also_after_a_restart(tiny_lm, tmp_path):
    from harness.server_utils import running_server

    config = ServerConfig(max_tokens=8, page_size=8, kv_cache_dir=tmp_path)
    with running_server([tiny_lm], config) as url:
        client = _live(url)
        r1 = client.responses.create(model=tiny_lm.name, input=LONG, instructions="Be brief.")
        r2 = client.responses.create(model=tiny_lm.name, input="And then?",
                                     instructions="Be brief.",  # instructions are not carried
                                     previous_response_id=r1.id)
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    with running_server([tiny_lm], config) as url:  # a new server on the same folder
        r3 = _live(url).responses.create(model=tiny_lm.name, input="Shorter.",
                                         instructions="Be brief.", previous_response_id=r2.id)
        stats = httpx.get(f"{url}/kv_cache/stats").json()
    assert r3.status in ("completed", "incomplete")
    assert r3.usage.input_tokens_details.cached_tokens >= r2.usage.input_tokens - 8, stats
    assert ResponseStore(tmp_path / "responses").get(r3.id)["response"]["id"] == r3.id


def test_live_codex_shaped_request_streams(live, tiny_lm):
    body = codex_body()
    body["model"] = tiny_lm.name
    with httpx.stream("POST", f"{live.url}/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(ln.removeprefix("data: ")) for ln in r.iter_lines()
                  if ln.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert events[-1]["response"]["store"] is False and len(events[-1]["response"]["tools"]) == 4
    gone = httpx.get(f"{live.url}/responses/{events[0]['response']['id']}")
    assert gone.status_code == 404  # store: false keeps nothing


def test_live_same_answer_as_chat_completions(live, tiny_lm):
    client = _live(live.url)
    r = client.responses.create(model=tiny_lm.name, input="What is the capital of France?",
                                instructions="You are a helpful assistant.", temperature=0,
                                max_output_tokens=8, extra_body={"use_kv_cache": False})
    c = client.chat.completions.create(model=tiny_lm.name, temperature=0, max_tokens=8,
                                       messages=[{"role": "system", "content":
                                                  "You are a helpful assistant."},
                                                 {"role": "user", "content":
                                                  "What is the capital of France?"}],
                                       extra_body={"use_kv_cache": False})
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens


def test_live_tool_round_trip_forced_by_grammar(live, tiny_lm):
    client = _live(live.url)
    params = {"type": "object", "properties": {"cmd": {"type": "string", "maxLength": 10}},
              "required": ["cmd"], "additionalProperties": False}
    tools = [{"type": "function", "name": "shell", "description": "Run a command",
              "parameters": params, "strict": True}]
    r = client.responses.create(model=tiny_lm.name, input="list the files", tools=tools,
                                tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=100)
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["shell"] and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["cmd"], str)
    r2 = client.responses.create(model=tiny_lm.name, previous_response_id=r.id, tools=tools,
                                 tool_choice="none", input=[{
                                     "type": "function_call_output",
                                     "call_id": calls[0].call_id, "output": "a.py b.py"}])
    assert r2.output[0].type == "message" and not [o for o in r2.output
                                                   if o.type == "function_call"]
    assert r2.usage.input_tokens_details.cached_tokens > 0


def test_logprobs_when_included():
    from mlx_kvserver.chat.output import TokenLogprob

    lp = TokenLogprob("Hi", 5, -0.25, (("Hi", 5, -0.25), ("Yo", 6, -2.0)))
    served = FakeServed([[Start(0, "x"), TextDelta(0, "Hi", (lp,)), Finish(0, "stop", "x", "Hi"),
                          Usage(3, 1, 0)]])
    client, _ = fake_client(served)
    r = client.responses.create(model="tiny", input="q", top_logprobs=2,
                                include=["message.output_text.logprobs"])
    got = r.output[0].content[0].logprobs
    assert [(g.token, g.logprob) for g in got] == [("Hi", -0.25)]
    assert [t.token for t in got[0].top_logprobs] == ["Hi", "Yo"]


def test_live_an_input_image_to_the_text_model_is_a_400(live, tiny_lm):
    client = _live(live.url)
    image = {"type": "input_image", "image_url": data_url(), "detail": "auto"}
    call = [{"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [image]}]
    for items in ([{"role": "user", "content": [{"type": "input_text", "text": "What?"},
                                                image]}], [{"role": "user", "content": "Look."},
                                                          *call]):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.responses.create(model=tiny_lm.name, input=items, stream=stream)
            assert e.value.body["type"] == "invalid_request_error"
            assert "no served model takes images" in e.value.body["message"]
    r = httpx.post(f"{live.url}/responses", json={"model": tiny_lm.name, "input": [
        {"role": "user", "content": [{"type": "input_image", "file_id": "file-abc"}]}]})
    assert r.status_code == 400 and "file_id" in r.json()["error"]["message"]


def test_what_sglangs_router_adds_is_taken_and_other_values_are_a_400():
    # sglang-router 0.3.2 sends every /v1/responses body on with these fields added
    added = {"store": True, "stream": None, "temperature": 1.0, "top_p": 1.0, "priority": 0,
             "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    conv = responses.parse({"input": "hi", **added}, CONFIG)
    assert conv.sampling.top_k == 0 and not conv.stream  # -1: top-k off; null: not streamed
    assert conv == responses.parse({"input": "hi", "temperature": 1.0}, CONFIG)
    for name, value in (("min_p", 0.05), ("repetition_penalty", 1.1), ("priority", 5),
                        ("top_k", -2), ("min_p", "0")):
        with pytest.raises(RequestError) as e:
            responses.parse({"input": "hi", **added, name: value}, CONFIG)
        assert e.value.status == 400 and e.value.param == name, (name, value)
