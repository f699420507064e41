"""JsonPrefix (chat/jsonstream.py) on random JSON objects fed in random chunks: it passes on only
valid JSON prefixes that end as the input does, stops at the value's end, and stops at the first
bad character keeping the rest for the caller."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from mlx_kvserver.chat.jsonstream import JsonPrefix

WS = st.text(alphabet=" \t\r\n", max_size=2)
NUMBER = st.from_regex(r"-?(0|[1-9][0-9]{0,4})(\.[0-9]{1,3})?([eE][+-]?[0-9]{1,3})?",
                       fullmatch=True)
ESCAPES = ['\\"', "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t"]
PLAIN = st.characters(blacklist_categories=("Cs",), blacklist_characters='"\\',
                      min_codepoint=0x20)
UNICODE_ESCAPE = st.builds(lambda n, up: "\\u" + (f"{n:04X}" if up else f"{n:04x}"),
                           st.integers(0, 0xFFFF), st.booleans())
RAW_CONTROL = st.characters(max_codepoint=0x1F)


def json_string(raw_controls: bool) -> st.SearchStrategy[str]:
    unit = PLAIN | st.sampled_from(ESCAPES) | UNICODE_ESCAPE
    if raw_controls:
        unit = unit | RAW_CONTROL
    return st.lists(unit, max_size=6).map(lambda us: '"' + "".join(us) + '"')


@st.composite
def array(draw, child):
    items = draw(st.lists(child, max_size=4))
    if not items:
        return "[" + draw(WS) + "]"
    return "[" + ",".join(draw(WS) + it + draw(WS) for it in items) + "]"


@st.composite
def obj(draw, child, key):
    members = draw(st.lists(st.tuples(key, child), max_size=4))
    if not members:
        return "{" + draw(WS) + "}"
    return "{" + ",".join(draw(WS) + k + draw(WS) + ":" + draw(WS) + v + draw(WS)
                          for k, v in members) + "}"


def json_object(raw_controls: bool = True) -> st.SearchStrategy[str]:
    """The text of a random JSON object (raw control characters in strings, when asked, as a
    lenient parser reads them) with random whitespace between its tokens."""
    s = json_string(raw_controls)
    leaf = NUMBER | st.sampled_from(["true", "false", "null"]) | s
    value = st.recursive(leaf, lambda c: array(c) | obj(c, s), max_leaves=10)
    return obj(value, s)


def feed_chunks(jp: JsonPrefix, text: str, cuts: list[int]) -> tuple[str, int]:
    """Feed ``text`` cut at ``cuts``: (passed on, characters consumed)."""
    out, used = "", 0
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        got, n = jp.feed(text[a:b])
        out, used = out + got, used + n
        if n < b - a:  # it stopped: nothing more is taken
            assert (jp.done or jp.error) and jp.feed(text[b:]) == ("", 0)
            break
    return out, used


def cuts_of(draw_text: str, data) -> list[int]:
    n = len(draw_text)
    return sorted(data.draw(st.sets(st.integers(1, max(1, n - 1)), max_size=8))) if n > 1 else []


@settings(max_examples=80, deadline=None)
@given(json_object(), WS, st.sampled_from(["", " ", "</tool_call>", '}{"x": 1}', ",", "]"]),
       st.data())
def test_random_object_in_random_chunks(body, lead, after, data):
    text = lead + body + after
    jp = JsonPrefix(require_object=True)
    out, used = feed_chunks(jp, text, cuts_of(text, data))
    assert json.loads(out) == json.loads(body, strict=False)  # strict: no raw control chars
    assert jp.done and jp.error is None and jp.closing() == ""
    assert used == len(lead + body)  # the value ends at its closing brace: nothing after it
    assert out.endswith("}") and jp.pending == ""
    # every prefix passed on is a JSON prefix: closing() completes it; done at the last "}"
    jp2, prefix = JsonPrefix(require_object=True), ""
    for i, ch in enumerate(text[:len(lead + body)]):
        prefix += jp2.feed(ch)[0]
        assert jp2.done == (i == len(lead + body) - 1)
        if jp2.started and not jp2.done:
            assert isinstance(json.loads(prefix + jp2.closing()), dict)
    assert prefix == out


@settings(max_examples=40, deadline=None)
@given(json_object(), st.data())
def test_raw_control_characters_come_out_escaped(body, data):
    raw = data.draw(st.lists(RAW_CONTROL, min_size=1, max_size=3).map("".join))
    text = body[:-1] + (", " if body[1:-1].strip() else "") + '"k": "a' + raw + 'b"}'
    out, _ = feed_chunks(JsonPrefix(True), text, cuts_of(text, data))
    assert '"a' + json.dumps(raw)[1:-1] + 'b"}' in out  # each as its JSON escape
    assert json.loads(out)["k"] == "a" + raw + "b"


# (bad suffix written after a member or right after "{", its error's offset in the suffix, what
# is held of the suffix when the error is met, error message)
BAD = [
    (', "k": 1,  }', 11, ",  ", "unexpected '}' where a key belongs"),
    (', "k": "ab\\qc"}', 11, "\\", "bad escape '\\\\q'"),
    (', "k": "\\u12G4"}', 12, "\\u12", "bad escape '\\\\u12G'"),
    (', "k": yes}', 7, "", "unexpected 'y' where a value belongs"),
    (', "k": trux}', 10, "tru", "not a JSON value: 'trux'"),
    (', "k": nul}', 10, "nul", "not a JSON value: 'nul'"),
    (', "k": 012}', 10, "012", "not a JSON value: '012'"),
    (', "k": -}', 8, "-", "not a JSON value: '-'"),
    (', "k": 1.}', 9, "1.", "not a JSON value: '1.'"),
    (', "k" 1}', 6, "", "unexpected '1' where ':' belongs"),
    (', "k": 1 2}', 9, "", "unexpected '2' after a value"),
    (', "a": 1, k: 1}', 10, ", ", "unexpected 'k' where a key belongs"),
    (', "k": [1,]}', 10, "", "unexpected ']' where a value belongs"),
]


@settings(max_examples=12, deadline=None)
@pytest.mark.parametrize("bad, offset, held, error", BAD)
@given(body=json_object(raw_controls=False), data=st.data())
def test_invalid_text_stops_at_the_first_bad_character(body, data, bad, offset, held, error):
    start = body[:-1].rstrip()
    if start == "{":  # no member before: the suffix starts the object
        bad, offset = bad[2:], offset - 2
    text = start + bad
    jp = JsonPrefix(require_object=True)
    out, used = feed_chunks(jp, text, cuts_of(text, data))
    assert jp.error == error and not jp.done
    assert used == len(start) + offset
    assert jp.held == held
    assert out + jp.held + text[used:] == text
    assert isinstance(json.loads(out + jp.closing()), dict)  # the valid part still closes


@pytest.mark.parametrize("text", ["[1]", '"s"', "3", "true", "  [1]"])
def test_require_object_refuses_another_value_at_its_first_character(text):
    jp = JsonPrefix(require_object=True)
    assert jp.feed(text) == ("", len(text) - len(text.lstrip()))
    assert jp.error == "the arguments are not a JSON object" and jp.held == ""
    assert jp.closing() == ""


def test_a_top_level_number_is_held_until_the_input_ends():
    jp = JsonPrefix()
    assert jp.feed("-12.5e3") == ("", 7) and jp.pending == "-12.5e3" and not jp.done
    assert jp.finish() == "-12.5e3" and jp.done and jp.pending == ""
    jp = JsonPrefix()
    assert jp.feed("12 x") == ("12", 3) and jp.done  # ended by what follows it
    jp = JsonPrefix()
    assert jp.feed("tru") == ("", 3) and jp.finish() == ""
    assert jp.error == "not a JSON value: 'tru'"


def test_held_pieces_and_closing_mid_value():
    jp = JsonPrefix(require_object=True)
    assert jp.feed('{"a": [1,') == ('{"a": [1', 9)
    assert jp.pending == "," and jp.closing() == "]}"  # a comma is held until what follows it
    assert jp.feed(' 2') == (', ', 2)
    assert jp.pending == "2" and jp.closing() == "null]}"  # a number is held until it ends
    assert jp.feed(']') == ("2]", 1)
    assert jp.closing() == "}"
    assert jp.feed(', "b": "x\\u00') == (', "b": "x', 13)
    assert jp.pending == "\\u00" and jp.closing() == '"}'
    assert jp.feed("e9") == ("\\u00e9", 2)
    assert jp.feed('", "c') == ('", "c', 5) and jp.closing() == '": null}'
    assert jp.feed('"') == ('"', 1) and jp.closing() == ": null}"
    assert jp.feed(':') == (':', 1) and jp.closing() == "null}"
    assert json.loads('{"a": [1, 2], "b": "x\\u00e9", "c":' + jp.closing()) == \
        {"a": [1, 2], "b": "xé", "c": None}

