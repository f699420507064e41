"""A forced tool call ends the answer, on the real default model through every API that has tools
(chat completions, Responses, Anthropic Messages), streamed and not, at several ``max_tokens``.

Before: ``tool_choice`` naming a function (or ``required``) gave 14 identical calls in 400 tokens
and ``finish_reason: "length"``; at ``max_tokens`` 60, two calls and the fragment ``<tool`` as the
message's content; Anthropic's ``any`` ended by ``max_tokens``. Now: a named tool gives exactly
one call and the end; ``required`` / ``any`` one or more complete calls, never a repeat, then the
end; ``parallel_tool_calls: false`` / ``disable_parallel_tool_use`` exactly one; and no markup
reaches the answer's text whatever ``max_tokens`` cuts. (``/v1/completions`` has no tools: its
text is the model's raw output by design.)

Issue 54 (tool calls an agent can run), with a tool whose parameters do not say
``additionalProperties``: before, the arguments carried the schema's own keys (``"description"``,
``"type"``, ``"properties"``) until ``max_tokens`` 60 cut the call (``finish_reason: "length"``);
with ``required`` / ``any`` a complete call was followed by a cut-off second one that the client
got (Anthropic's ``input``: ``{"location": "Paris", "unit": null, "INVALID_JSON": ...}``, a
``null`` the model never wrote). Now only declared keys, values within their enum, a call cut off
is never part of the answer (a streamed first call shows what was written, nothing added), and at
``max_tokens`` 60 a named tool and ``any`` end with complete calls (``tool_calls`` / ``tool_use``).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest

from mlx_kvserver.config import ServerConfig
from harness.server_utils import running_server

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": PARAMS}}]
RESP_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
               "parameters": PARAMS}]
ANT_TOOLS = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": PARAMS}]
ASK = "What's the weather in Paris?"
ENOUGH, MID_CALL, IN_NAME, BEFORE_NAME = 200, 20, 12, 3
# issue 54's tool: an enum, and nothing said of undeclared keys
UNIT = ["celsius", "fahrenheit"]
OPEN = {"type": "object", "properties": {
    "location": {"type": "string", "description": "The city"},
    "unit": {"type": "string", "enum": UNIT}}, "required": ["location"]}
SMALL = 60  # the issue's max_tokens


@pytest.fixture(scope="module")
def url():
    from mlx_kvserver.models.loading import resolve_and_load

    lm = resolve_and_load("default")
    with running_server([lm], ServerConfig(max_batch=16)) as u:
        yield u, lm.name


def chat(url, name, mode, max_tokens, stream, parallel=True, params=PARAMS):
    c = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    choice = "required" if mode == "required" else {"type": "function",
                                                    "function": {"name": "get_weather"}}
    tools = [{"type": "function", "function": {**CHAT_TOOLS[0]["function"],
                                               "parameters": params}}]
    kw = dict(model=name, messages=[{"role": "user", "content": ASK}], tools=tools,
              tool_choice=choice, max_tokens=max_tokens, temperature=0,
              parallel_tool_calls=parallel)
    if not stream:
        r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        return dict(text=m.content or "", finish=r.choices[0].finish_reason, deltas=None,
                    calls=[(t.function.name, t.function.arguments) for t in m.tool_calls or []])
    text, calls, deltas, finish = "", {}, {}, None
    for ch in c.chat.completions.create(**kw, stream=True):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        text += d.content or ""
        for t in d.tool_calls or []:
            call = calls.setdefault(t.index, ["", ""])
            call[0] += t.function.name or ""
            if t.function.arguments:
                call[1] += t.function.arguments
                deltas[t.index] = deltas.get(t.index, 0) + 1
        finish = ch.choices[0].finish_reason or finish
    return dict(text=text, finish=finish, deltas=[deltas.get(i, 0) for i in sorted(calls)],
                calls=[tuple(calls[i]) for i in sorted(calls)])


def responses(url, name, mode, max_tokens, stream, parallel=True, params=PARAMS):
    c = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    choice = "required" if mode == "required" else {"type": "function", "name": "get_weather"}
    kw = dict(model=name, input=ASK, tools=[{**RESP_TOOLS[0], "parameters": params}],
              tool_choice=choice, max_output_tokens=max_tokens, temperature=0,
              parallel_tool_calls=parallel)
    deltas: dict[str, int] = {}
    if stream:
        r = None
        for ev in c.responses.create(**kw, stream=True):
            if ev.type == "response.function_call_arguments.delta":
                deltas[ev.item_id] = deltas.get(ev.item_id, 0) + 1
            if ev.type in ("response.completed", "response.incomplete"):
                r = ev.response
        assert r is not None
    else:
        r = c.responses.create(**kw)
    calls = [i for i in r.output if i.type == "function_call"]
    text = "".join(p.text for i in r.output if i.type == "message" for p in i.content)
    return dict(text=text, finish=r.status if r.status == "incomplete" or not calls else
                "tool_calls", deltas=[deltas.get(i.id, 0) for i in calls] if stream else None,
                calls=[(i.name, i.arguments) for i in calls])


def messages(url, name, mode, max_tokens, stream, parallel=True, params=PARAMS):
    c = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="x", max_retries=0)
    choice = {"type": "any"} if mode == "required" else {"type": "tool", "name": "get_weather"}
    if not parallel:
        choice["disable_parallel_tool_use"] = True
    kw = dict(model=name, max_tokens=max_tokens, tool_choice=choice,
              tools=[{**ANT_TOOLS[0], "input_schema": params}],
              messages=[{"role": "user", "content": ASK}])
    if stream:
        with c.messages.stream(**kw) as s:
            r = s.get_final_message()
    else:
        r = c.messages.create(**kw)
    text = "".join(b.text for b in r.content if b.type == "text")
    calls = [(b.name, json.dumps(b.input)) for b in r.content if b.type == "tool_use"]
    finish = {"tool_use": "tool_calls", "max_tokens": "length"}.get(r.stop_reason, r.stop_reason)
    return dict(text=text, finish=finish, deltas=None, calls=calls)


APIS = {"chat": chat, "responses": responses, "messages": messages}
CUT = {"chat": "length", "responses": "incomplete", "messages": "length"}
CASES = [(api, mode, n, stream) for api in APIS for mode in ("named", "required")
         for n in (ENOUGH, MID_CALL, IN_NAME, BEFORE_NAME) for stream in (False, True)]
# issue 54: the open schema through both APIs, at the issue's max_tokens and with room to end
ISSUE = [("issue", api, mode, n, stream) for api in ("chat", "messages")
         for mode in ("named", "required") for n in (SMALL, ENOUGH) for stream in (False, True)]


@pytest.fixture(scope="module")
def results(url):
    u, name = url
    with ThreadPoolExecutor(8) as pool:  # the server batches them
        futures = {case: pool.submit(APIS[case[0]], u, name, *case[1:]) for case in CASES}
        futures.update({(api, "parallel-off"): pool.submit(APIS[api], u, name, "required",
                                                           ENOUGH, True, False)
                        for api in APIS})
        futures.update({case: pool.submit(APIS[case[1]], u, name, *case[2:], params=OPEN)
                        for case in ISSUE})
        return {k: f.result() for k, f in futures.items()}


@pytest.mark.parametrize("api,mode,max_tokens,stream", CASES)
def test_a_forced_call_ends_the_answer(results, api, mode, max_tokens, stream):
    r = results[(api, mode, max_tokens, stream)]
    assert r["text"] == "", r  # no markup, and no text beside a forced call, ever
    if max_tokens == ENOUGH:
        assert r["finish"] == "tool_calls", r
        assert len(r["calls"]) == 1 if mode == "named" else len(r["calls"]) >= 1, r
        assert len(set(r["calls"])) == len(r["calls"]), r  # never a repeated call
        for name, args in r["calls"]:
            assert name == "get_weather" and isinstance(json.loads(args)["city"], str), r
        if r["deltas"] is not None:  # the arguments streamed in pieces, not in one
            assert all(n > 1 for n in r["deltas"]), r
    else:
        assert r["finish"] == CUT[api], r
        assert all(name == "get_weather" for name, _ in r["calls"]), r
        if max_tokens == MID_CALL and stream and api != "responses":
            # the first call streams as the model writes it: the client saw its start, and no
            # more than the model wrote (nothing closes it); finish_reason says it was cut
            (name, args), = r["calls"]
            if api == "chat":
                assert args.startswith('{"city": ') and _not_json(args), r
            else:  # Anthropic's SDK reads the valid part: only values written whole, no more
                assert set(json.loads(args)) <= {"city"}, r
        else:  # a call cut off is not a call of the answer (Responses' final output drops it)
            assert r["calls"] == [], r


@pytest.mark.parametrize("api", APIS)
def test_parallel_calls_off_gives_exactly_one(results, api):
    r = results[(api, "parallel-off")]
    assert r["finish"] == "tool_calls" and len(r["calls"]) == 1 and r["text"] == "", r


def test_the_same_answer_streamed_and_not(results):
    for api in APIS:
        for mode in ("named", "required"):
            for n in (ENOUGH, MID_CALL, IN_NAME, BEFORE_NAME):
                a, b = results[(api, mode, n, False)], results[(api, mode, n, True)]
                assert (a["text"], a["finish"]) == (b["text"], b["finish"]), (api, mode, n)
                if n == MID_CALL and api != "responses":
                    continue  # the streamed first call was seen as written (above)
                assert [c[0] for c in a["calls"]] == [c[0] for c in b["calls"]], (api, mode, n)
                if n == ENOUGH:
                    assert [json.loads(c[1]) for c in a["calls"]] == \
                        [json.loads(c[1]) for c in b["calls"]]


@pytest.mark.parametrize("case", ISSUE, ids=["-".join(map(str, c[1:])) for c in ISSUE])
def test_issue_54_calls_an_agent_can_run(results, case):
    """Only declared keys, values within the enum, complete calls, and the answer ends with
    them: ``tool_calls`` / ``tool_use`` even at ``max_tokens`` 60."""
    _, api, mode, n, stream = case
    r = results[case]
    assert r["text"] == "" and r["finish"] == "tool_calls", r
    assert len(r["calls"]) == 1 if mode == "named" else len(r["calls"]) >= 1, r
    for name, args in r["calls"]:
        value = json.loads(args)  # complete: it parses as written
        assert name == "get_weather" and set(value) <= {"location", "unit"}, r
        assert isinstance(value["location"], str) and value.get("unit", UNIT[0]) in UNIT, r
    if n == SMALL:  # the same greedy answer as with room, cut before a later call ended
        more = results[("issue", api, mode, ENOUGH, stream)]["calls"]
        assert r["calls"] == more[:len(r["calls"])], (r, more)


def test_a_later_call_cut_off_is_not_sent(results):
    """With ``required`` / ``any`` at ``max_tokens`` 60 the model was writing a second call when
    the budget ran out (it writes two with room): the answer holds the first, streamed or not."""
    for api in ("chat", "messages"):
        for stream in (False, True):
            cut = results[("issue", api, "required", SMALL, stream)]["calls"]
            whole = results[("issue", api, "required", ENOUGH, stream)]["calls"]
            assert len(whole) == 2 and cut == whole[:1], (api, stream, cut, whole)


def test_calls_cut_off_are_counted_in_metrics(url, results):
    """Every call that ``max_tokens`` cut off is counted in /metrics as ``truncated`` (the ones
    at MID_CALL, one a case) or, cut before the tool's name, as ``dropped`` (IN_NAME); at
    ``max_tokens`` 60, each later call cut off (one per answer with fewer calls than with room)
    is one or the other; nothing else was a problem."""
    import httpx

    u, name = url
    text = httpx.get(u.removesuffix("/v1") + "/metrics", timeout=30).text
    counts = {line.split('kind="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines()
              if line.startswith("mlx_kvserver_tool_call_problems_total{")}
    mid = sum(1 for (api, *rest) in results if rest[1:2] == [MID_CALL])
    in_name = sum(1 for (api, *rest) in results if rest[1:2] == [IN_NAME])
    later = sum(1 for c in ISSUE if c[3] == SMALL and len(results[c]["calls"]) <
                len(results[c[:3] + (ENOUGH,) + c[4:]]["calls"]))
    assert later > 0 and set(counts) == {"truncated", "dropped"}, counts
    assert counts["truncated"] >= mid and counts["dropped"] >= in_name, counts
    assert counts["truncated"] + counts["dropped"] == mid + in_name + later, counts


def _not_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return True
    return False
