"""CallTracker (chat/call_events.py) fed hand-made reader pieces: call ids, repeated calls end the
answer, calls after a complete one held until they are complete (one cut off is never sent),
calls that cannot be run kept out of the answer, parallel off, the problems it finds or is given,
blocks without a call."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings, strategies as st

from mlx_kvserver.chat.call_events import CallTracker
from mlx_kvserver.chat.calls import Args, Dropped, End, Name, Unparsed
from mlx_kvserver.chat.conversation import Tool
from mlx_kvserver.chat.output import ToolCallDelta, ToolCallEnd, ToolCallStart

TOOLS = [Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}},
                                  "required": ["city"]}),
         Tool("get_time", "", {"type": "object", "properties": {"zone": {"type": "string"}}})]


def call(name, *args, problem=None, valid=True):
    return [Name(name), *(Args(a, valid) for a in args), End(problem)]


def shape(deltas):
    """The deltas without ids: ("start", call, name) / ("args", call, text, valid) / ("end", call,
    problem)."""
    out = []
    for d in deltas:
        if isinstance(d, ToolCallStart):
            out.append(("start", d.call, d.name))
        elif isinstance(d, ToolCallDelta):
            out.append(("args", d.call, d.arguments, d.valid))
        else:
            out.append(("end", d.call, d.problem))
    assert all(d.index == 2 for d in deltas)
    return out


def test_ids_are_fresh_and_every_call_ends():
    t = CallTracker(2, TOOLS)
    deltas, back = t.take(call("get_weather", '{"city": ', '"Paris"}') +
                          call("get_time", "{}") + call("get_weather", '{"city": "Rome"}'))
    assert back == []
    starts = [d for d in deltas if isinstance(d, ToolCallStart)]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", s.id) for s in starts)
    assert len({s.id for s in starts}) == 3 and [s.id for s in starts] == [c.id for c in t.calls]
    assert shape(deltas) == [
        ("start", 0, "get_weather"), ("args", 0, '{"city": ', True),
        ("args", 0, '"Paris"}', True), ("end", 0, None),
        ("start", 1, "get_time"), ("args", 1, "{}", True), ("end", 1, None),
        ("start", 2, "get_weather"), ("args", 2, '{"city": "Rome"}', True), ("end", 2, None)]
    assert [(c.name, c.arguments, c.problem) for c in t.calls] == [
        ("get_weather", '{"city": "Paris"}', None), ("get_time", "{}", None),
        ("get_weather", '{"city": "Rome"}', None)]
    assert not t.ended and t.problems == []


def test_pieces_outside_a_call_are_ignored():
    assert CallTracker(2, TOOLS).take([Args("{}"), End()]) == ([], [])


def test_a_repeated_call_is_never_emitted_and_ends_the_answer():
    t = CallTracker(2, TOOLS)
    t.take(call("get_weather", '{"city": "Paris"}'))
    assert all(t.take([p]) == ([], []) for p in call("get_weather", '{"city": ', '"Paris"}'))
    assert t.ended and len(t.calls) == 1
    # what follows an ended answer is not emitted either
    assert t.take(call("get_time", "{}")) == ([], []) and len(t.calls) == 1


def test_a_call_after_a_complete_one_is_sent_whole_once_it_is_complete():
    t = CallTracker(2, TOOLS)
    t.take(call("get_weather", '{"city": "Paris"}'))
    assert t.take([Name("get_weather")]) == ([], [])
    assert t.take([Args('{"city": "Pa')]) == ([], [])
    assert t.take([Args('ris2"}')]) == ([], [])  # no longer the first call's: still held
    deltas, _ = t.take([End()])
    assert shape(deltas) == [("start", 1, "get_weather"), ("args", 1, '{"city": "Pa', True),
                             ("args", 1, 'ris2"}', True), ("end", 1, None)]
    assert deltas[0].id == t.calls[1].id != t.calls[0].id and not t.ended
    # another tool's call, the same arguments: held all the same, sent at its end
    assert t.take([Name("get_time"), Args("{}")]) == ([], [])
    assert shape(t.take([End()])[0]) == [("start", 2, "get_time"), ("args", 2, "{}", True),
                                         ("end", 2, None)]


@pytest.mark.parametrize("tail, problem", [
    ([Args('{"city": "Pa'), End("truncated")], "truncated"),
    ([Args('{"city": "Rome"}'), End("truncated")], "truncated"),  # cut before its markup ended
    ([Args('{"city": '), Args("Rome}", valid=False), End("invalid_json: x")], "invalid_json: x"),
    ([End("truncated")], "truncated"),
])
def test_a_later_call_cut_off_or_broken_is_never_sent(tail, problem):
    t = CallTracker(2, TOOLS)
    t.take(call("get_weather", '{"city": "Paris"}'))
    assert t.take([Name("get_weather")] + tail[:-1]) == ([], [])
    deltas, back = t.take(tail[-1:])
    assert back == [] and shape(deltas) == [("end", -1, problem)]  # no call: only its problem
    assert [c.arguments for c in t.calls] == ['{"city": "Paris"}'] and not t.ended
    assert [(c.name, c.problem) for c in t.read[1:]] == [("get_weather", problem)]
    assert t.problems == [problem]
    # a call after it takes the next number the client sees
    assert shape(t.take(call("get_time", "{}"))[0])[0] == ("start", 1, "get_time")


def test_parallel_off_ends_the_answer_after_the_first_call():
    t = CallTracker(2, TOOLS, parallel=False)
    deltas, _ = t.take(call("get_time", "{}"))
    assert shape(deltas) == [("start", 0, "get_time"), ("args", 0, "{}", True), ("end", 0, None)]
    assert t.ended
    assert t.take(call("get_weather", '{"city": "Rome"}') + call("get_time", "{}")) == ([], [])
    assert len(t.calls) == 1
    # a call with a problem is still the first call
    t = CallTracker(2, TOOLS, parallel=False)
    t.take(call("nope", "{}"))
    assert t.ended and t.take(call("get_time", "{}")) == ([], [])


@pytest.mark.parametrize("pieces, problem", [
    (call("nope", "{}"), "unknown_tool: 'nope' is not among the tools offered"),
    (call("get_weather", '{"city": 3}'), "schema: 3 is not of type 'string'"),
    (call("get_weather", "{}"), "schema: 'city' is a required property"),
    (call("get_weather", "[1]"), "invalid_json: the arguments are not a JSON object"),
    (call("nope", "hello", valid=False), "invalid_json: Expecting value: line 1 column 1 (char 0)"),
    (call("get_weather", '{"city": "Pa', problem="truncated"), "truncated"),
    ([Name("get_weather"), Args('{"city": '), Args("Paris}", valid=False),
      End("invalid_json: unexpected 'P' where a value belongs")],
     "invalid_json: unexpected 'P' where a value belongs"),
    (call("get_weather", '{"city": "Paris"}', problem="invalid_markup: x"), "invalid_markup: x"),
])
def test_problems(pieces, problem):
    t = CallTracker(2, TOOLS)
    deltas, back = t.take(pieces)
    assert back == [] and shape(deltas)[-1] == ("end", 0, problem)
    assert [d.valid for d in deltas if isinstance(d, ToolCallDelta)] == \
        [p.valid for p in pieces if isinstance(p, Args)]
    written = "".join(p.text for p in pieces if isinstance(p, Args))
    runnable = not problem.startswith(("truncated", "invalid_json"))
    # the first call streams as written; one that is cut off or not JSON is not the answer's
    assert [(c.arguments, c.problem) for c in t.read] == [(written, problem)]
    assert t.calls == (t.read if runnable else [])
    assert t.problems == [problem] and not t.ended


def test_a_schema_that_cannot_be_checked_is_not_checked():
    t = CallTracker(2, [Tool("odd", "", {"type": "no such type"})])
    assert shape(t.take(call("odd", '{"a": 1}'))[0])[-1] == ("end", 0, None)


def test_a_block_with_no_call_gives_its_text_back():
    t = CallTracker(2, TOOLS)
    deltas, back = t.take([Unparsed("hello\n  there")])
    assert back == ["hello\n  there"]
    assert shape(deltas) == [("end", -1, "unparsed: a tool-call block with no call in it: "
                                         "hello there")]
    long = "x" * 200
    deltas, back = t.take([Unparsed(long)])
    assert back == [long] and deltas[0].problem.endswith(": " + "x" * 117 + "...")
    deltas, back = t.take([Dropped('{"name": "get_wea')])
    assert back == [] and shape(deltas) == \
        [("end", -1, "dropped: cut off before the tool's name: {\"name\": \"get_wea")]
    assert len(t.problems) == 3 and t.calls == [] and not t.ended


CALLS = st.tuples(st.sampled_from(["get_weather", "get_time", "nope"]),
                  st.sampled_from(['{"city": "Paris"}', '{"city": "Paris", "days": 1}', "{}",
                                   '{"city": "Pa']),
                  st.sampled_from([None, "truncated"]), st.integers(1, 4))


@settings(max_examples=150, deadline=None)
@given(st.lists(CALLS, max_size=6), st.booleans())
def test_random_call_sequences(calls, parallel):
    t = CallTracker(2, TOOLS, parallel=parallel)
    deltas = []
    answer, streamed, withheld, ended = [], [], 0, False
    for name, args, problem, parts in calls:
        cut = [args[i * len(args) // parts:(i + 1) * len(args) // parts] for i in range(parts)]
        for p in call(name, *cut, problem=problem):
            deltas += t.take([p])[0]
        if ended:
            continue
        if answer and (name, args) in answer:  # a repeat ends the answer, unsent
            ended = True
            continue
        ok = problem is None and args.endswith("}")
        if ok or not answer:  # sent: a complete call, or the first call as it is written
            checked = "unknown_tool" if name == "nope" else \
                "schema" if (name, args) == ("get_weather", "{}") else None
            streamed.append((name, args, checked if ok else problem or "invalid_json"))
        if ok:
            answer.append((name, args))
        else:
            withheld += bool(answer)
        ended = not parallel
    assert [(c.name, c.arguments) for c in t.calls] == answer and t.ended == ended
    emitted = shape(deltas)
    for n, (name, args, problem) in enumerate(streamed):
        mine = [d for d in emitted if d[1] == n]
        assert mine[0] == ("start", n, name) and mine[-1][0] == "end"
        assert (mine[-1][2] or "").split(":")[0] == (problem or "")
        assert "".join(d[2] for d in mine[1:-1]) == args and len(mine) >= 3
        assert [d[0] for d in mine].count("end") == 1
    assert len([d for d in emitted if d[1] == -1]) == withheld  # unsent: only its problem
    assert [d[1] for d in emitted if d[1] >= 0] == sorted(d[1] for d in emitted if d[1] >= 0)
