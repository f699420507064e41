"""Call readers of the JSON formats (chat/calls.py) fed character by character: names and
arguments stream as they are written, several calls per block, the whole-parse fallback,
arguments as a JSON string, cut-off and unreadable blocks, invalid JSON midway; pythonic's
WholeReader. The XML formats and Gemma 4 are in test_xml_calls.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from mlx_kvserver.chat.calls import Args, Dropped, End, Name, Unparsed, WholeReader
from mlx_kvserver.chat.readers import reader_for
from tests.chat.test_jsonstream import json_object

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "opts": {"type": "object"}}}}}]


def stream(parser, body, closed=True, tools=TOOLS):
    """The pieces of ``body`` fed a character at a time, each with how many characters had been
    fed when it came (``len(body) + 1``: at ``close``)."""
    r = reader_for(parser, tools)
    got = [(i, p) for i in range(1, len(body) + 1) for p in r.feed(body[i - 1])]
    return got + [(len(body) + 1, p) for p in r.close(closed)]


def summary(pieces):
    """Per call (name, valid arguments text, invalid arguments text, End's problem); Unparsed and
    Dropped as they are. A call's valid fragments all come before its invalid ones."""
    out = []
    for p in pieces:
        if isinstance(p, Name):
            out.append([p.name, "", "", "open"])
        elif isinstance(p, Args):
            assert out and out[-1][3] == "open", p
            assert not (p.valid and out[-1][2]), p
            out[-1][1 if p.valid else 2] += p.text
        elif isinstance(p, End):
            assert out[-1][3] == "open"
            out[-1][3] = p.problem
        else:
            out.append(p)
    return [tuple(c) if isinstance(c, list) else c for c in out]


def whole(parser, body, closed=True, tools=TOOLS):
    r = reader_for(parser, tools)
    return summary(r.feed(body) + r.close(closed))


def check_streams(parser, body, expected, tools=TOOLS):
    """``body`` gives the calls ``expected`` ((name, arguments text)), the same fed whole or by
    character, and each value starting "P" or "R" streams: that character's Args piece comes as
    it is fed, before the rest of the arguments."""
    got = stream(parser, body, tools=tools)
    assert summary([p for _, p in got]) == [(n, a, "", None) for n, a in expected]
    assert whole(parser, body, tools=tools) == summary([p for _, p in got])
    for word in ("Paris", "Rome"):
        if word in body:
            assert (body.index(word) + 1, Args(word[0])) in got
    return got


H = '{"name": "get_weather", "arguments": '
KIMI = "<|tool_call_begin|>functions.get_weather:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"
DS3 = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{}\n```<｜tool▁call▁end｜>"
DS31 = "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
P, R = '{"city": "Paris", "days": 3}', '{"city":"Rome","opts":{"a":[1, 2.5e-3]},"metric":true}'

STREAMED = {
    "json_tools": ("json_tools", H + P + "}", [P]),
    "fallback": ("fallback", "\n" + H + P + "}\n", [P]),
    "llama3_json": ("llama3_json", '{"name": "get_weather", "parameters": ' + P + "}; "
                    '{"name": "get_weather", "parameters": ' + R + "}", [P, R]),
    "mistral_list": ("mistral", " [" + H + P + "}, " + H + R + "}]", [P, R]),
    "mistral_args": ("mistral", "get_weather[ARGS]" + P, [P]),
    "mistral_call_id": ("mistral", "get_weather[CALL_ID]a1b2[ARGS]" + P, [P]),
    "kimi_k2": ("kimi_k2", KIMI.format(0, P) + "\n" + KIMI.format(1, R), [P, R]),
    "deepseek_v3": ("deepseek_v3", DS3.format(P) + "\n" + DS3.format(R), [P, R]),
    "deepseek_v31": ("deepseek_v3", DS31.format(P) + DS31.format(R), [P, R]),
}


@pytest.mark.parametrize("case", STREAMED)
def test_arguments_stream_as_written(case):
    parser, body, args = STREAMED[case]
    got = check_streams(parser, body, [("get_weather", a) for a in args])
    first = next(i for i, p in got if isinstance(p, Args))
    assert first == body.index(args[0]) + 1  # "{" goes out as soon as it is read
    assert next(i for i, p in got if isinstance(p, Name)) < first
    assert [type(p) for _, p in got].count(End) == len(args)


def test_whole_reader_parses_at_the_end():
    body = '[get_weather(city="Paris", days=3), get_weather(city="Rome")]'
    r = reader_for("pythonic", TOOLS)
    assert isinstance(r, WholeReader)
    assert all(r.feed(ch) == [] for ch in body)
    assert r.close(True) == [Name("get_weather"), Args('{"city": "Paris", "days": 3}'), End(),
                             Name("get_weather"), Args('{"city": "Rome"}'), End()]
    assert whole("pythonic", "[get_weather(", closed=False) == [Dropped("[get_weather(")]
    assert whole("pythonic", "just text") == [Unparsed("just text")]


@pytest.mark.parametrize("parser, body", [
    ("json_tools", '{"arguments": {"city": "Paris"}, "name": "get_weather"}'),
    ("llama3_json", '{"parameters": {"city": "Paris"}, "name": "get_weather"}'),
    ("mistral", '[{"arguments": {"city": "Paris"}, "name": "get_weather"}]'),
])
def test_keys_in_another_order_are_parsed_whole_at_the_end(parser, body):
    got = stream(parser, body)
    assert all(i == len(body) + 1 for i, _ in got)  # nothing before close
    assert [p for _, p in got] == [Name("get_weather"), Args('{"city": "Paris"}'), End()]


@pytest.mark.parametrize("parser, body", [
    ("json_tools", H + '"{\\"city\\": \\"Paris\\"}"}'),
    ("llama3_json", '{"name": "get_weather", "parameters": "{\\"city\\": \\"Paris\\"}"}'),
])
def test_arguments_written_as_a_json_string_come_whole_at_its_end(parser, body):
    got = stream(parser, body)
    colon, end_quote = body.index(': "{') + 1, body.rindex('"') + 1
    assert got == [(colon, Name("get_weather")), (end_quote, Args('{"city": "Paris"}')),
                   (len(body), End())]
    # a string that does not hold an object: the text, not valid (the tracker calls it invalid)
    assert whole(parser, body[:colon] + ' "hello"}') == \
        [("get_weather", "", "hello", None)]


def test_text_after_a_single_call_goes_back():
    assert whole("json_tools", H + P + "} and more") == \
        [("get_weather", P, "", None), Unparsed(" and more")]
    assert whole("kimi_k2", KIMI.format(0, P) + " junk") == \
        [("get_weather", P, "", None), Unparsed("junk")]


@pytest.mark.parametrize("case", [*STREAMED, "pythonic"])
def test_cut_off_inside_the_name_is_dropped(case):
    parser, body, _ = STREAMED.get(case, ("pythonic", "[get_weather(city='Paris')]", None))
    for cut in (body.index("get_weather") + 7, body.index("get_weather") + 11):
        assert whole(parser, body[:cut], closed=False) == [Dropped(body[:cut])]


@pytest.mark.parametrize("case", STREAMED)
def test_cut_off_inside_the_arguments_is_truncated(case):
    parser, body, args = STREAMED[case]
    cut = body.index("Paris") + 3
    assert summary([p for _, p in stream(parser, body[:cut], closed=False)]) == \
        [("get_weather", '{"city": "Par', "", "truncated")]
    # a number held when the cut came is passed on as written, not valid
    cut = body.index("3") + 1
    assert whole(parser, body[:cut], closed=False) == \
        [("get_weather", '{"city": "Paris", "days": ', "3", "truncated")]
    assert whole(parser, body[:body.index(args[0])], closed=False)[0][1:] == ("", "", "truncated")


@pytest.mark.parametrize("parser", ["json_tools", "fallback", "llama3_json", "mistral",
                                    "kimi_k2", "deepseek_v3", "pythonic"])
def test_a_closed_block_with_no_call_goes_back_as_text(parser):
    assert whole(parser, "hello there") == [Unparsed("hello there")]
    assert whole(parser, " \n") == [] and whole(parser, "", closed=False) == []


@pytest.mark.parametrize("parser, body, valid, problem", [
    ("json_tools", H + '{"city": "Paris", "days": 3,}}', '{"city": "Paris", "days": 3',
     "unexpected '}' where a key belongs"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": Paris}}', '{"city": ',
     "unexpected 'P' where a value belongs"),
    ("mistral", "[" + H + '{"city": "Pa\\qris"}}]', '{"city": "Pa', "bad escape '\\\\q'"),
    ("mistral", 'get_weather[ARGS]{"days": 03}', '{"days": ', "not a JSON value: '03'"),
    ("kimi_k2", KIMI.format(0, '{"city": "Paris" "days": 3}'), '{"city": "Paris" ',
     "unexpected '\"' after a value"),
    ("deepseek_v3", DS3.format('{"metric": tru}'), '{"metric": ', "not a JSON value: 'tru'"),
    ("deepseek_v3", DS31.format('{"city": "Paris",, "days": 3}'), '{"city": "Paris"',
     "unexpected ',' where a key belongs"),
])
def test_invalid_json_midway(parser, body, valid, problem):
    got = stream(parser, body)
    start = body.index(valid)
    rest = body[start + len(valid):]  # the rest of the block as written
    assert summary([p for _, p in got]) == [("get_weather", valid, rest, "invalid_json: " + problem)]
    bad = [i for i, p in got if isinstance(p, Args) and not p.valid]
    assert bad[0] <= start + len(valid) + 4  # as it is fed, not at the block's end
    assert whole(parser, body) == summary([p for _, p in got])


@pytest.mark.parametrize("parser, body, problem", [
    ("json_tools", H + '{"city": "Paris"', "the arguments end before they are complete"),
    ("json_tools", H, "no arguments"),
])
def test_a_closed_block_with_unfinished_arguments(parser, body, problem):
    assert whole(parser, body)[0][3] == "invalid_json: " + problem


@settings(max_examples=40, deadline=None)
@given(json_object(), st.sampled_from(["json_tools", "llama3_json", "kimi_k2", "deepseek_v3"]),
       st.data())
def test_random_arguments_in_random_chunks(args, parser, data):
    body = {"json_tools": H + args + "}", "llama3_json": H + args + "}",
            "kimi_k2": KIMI.format(0, args), "deepseek_v3": DS31.format(args)}[parser]
    cuts = sorted(data.draw(st.sets(st.integers(1, len(body) - 1), max_size=10)))
    r = reader_for(parser, TOOLS)
    pieces = [p for a, b in zip([0, *cuts], [*cuts, len(body)]) for p in r.feed(body[a:b])]
    ((name, text, bad, problem),) = summary(pieces + r.close(True))
    assert (name, bad, problem) == ("get_weather", "", None)
    assert json.loads(text) == json.loads(args, strict=False)


@pytest.mark.parametrize("parser, body", [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"parameters": {"city": "Rome"}, "name": "get_weather"}'),
    ("mistral", "[" + H + '{"city": "Paris"}}, {"arguments": {"city": "Rome"}, '
                '"name": "get_weather"}]'),
])
def test_a_later_call_with_keys_in_another_order_is_still_a_call(parser, body):
    assert whole(parser, body) == [("get_weather", '{"city": "Paris"}', "", None),
                                   ("get_weather", '{"city": "Rome"}', "", None)]
