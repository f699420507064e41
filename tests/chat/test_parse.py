"""OutputParser on recorded outputs of each format, fed whole, by character and in random
chunks (the result must not depend on the chunking)."""

from __future__ import annotations

import json
import random
import re

import pytest

from mlx_kvserver.chat.call_events import runnable
from mlx_kvserver.chat.conversation import Tool, ToolCall
from mlx_kvserver.chat.formats import ChatFormat, detect
from mlx_kvserver.chat.output import (ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd,
                                      ToolCallStart)
from mlx_kvserver.chat.parse import OutputParser
from mlx_kvserver.chat.render import fallback_call
from tests.chat.templates import make_chat_tokenizer
from tests.chat.test_corpus import check_deltas

TOOLS = [Tool("get_weather", "Weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}),
    Tool("get_time", "Time", {"type": "object", "properties": {"zone": {"type": "string"}}})]
_FORMATS: dict[str, ChatFormat] = {}


def fmt(family: str) -> ChatFormat:
    if family not in _FORMATS:
        _FORMATS[family] = detect(make_chat_tokenizer(family))
    return _FORMATS[family]


def run(family: str, text: str, chunks: list[str], tools=TOOLS, in_reasoning=False):
    p = OutputParser(fmt(family), 3, tools, in_reasoning=in_reasoning)
    deltas = [d for c in chunks for d in p.feed(c)] + p.finish()
    assert "".join(chunks) == text
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == p.text
    assert "".join(d.text for d in deltas if isinstance(d, ReasoningDelta)) == p.reasoning
    check_deltas(p, deltas)
    assert all(d.index == 3 for d in deltas)
    return p.text, p.reasoning, [(c.name, json.loads(c.arguments)) for c in p.tool_calls]


def chunkings(text: str, seed: int = 0):
    yield [text]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(25):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def parse(family: str, text: str, **kw):
    results = {repr(run(family, text, c, **kw)) for c in chunkings(text)}
    assert len(results) == 1, results
    return run(family, text, [text], **kw)


PARIS = {"city": "Paris"}
CASES = [
    # hermes / json_tools (Qwen2.5): text, then two calls
    ("qwen25", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
     '\n</tool_call>', False,
     ("Let me check.", "", [("get_weather", PARIS), ("get_time", {"zone": "UTC"})])),
    # Qwen3: a think block, then a call
    ("qwen3", '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": '
     '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', False,
     ("", "The user wants weather.", [("get_weather", PARIS)])),
    # Qwen3: thinking and an answer
    ("qwen3", "<think>\nShort.\n\n</think>\n\nIt is **18C**.\n\nEnjoy!", False,
     ("It is **18C**.\n\nEnjoy!", "Short.", [])),
    # a prompt that ended inside <think>
    ("qwen3", "Hmm, easy.\n</think>\n\nParis.", True, ("Paris.", "Hmm, easy.", [])),
    # qwen3_coder XML, typed by the tool's schema
    ("qwen3_coder", "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"
     "\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", False,
     ("I'll look.", "", [("get_weather", {"city": "Paris", "days": 3})])),
    # mistral v0.3: a JSON list after [TOOL_CALLS] (no end marker)
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}}]', False,
     ("", "", [("get_weather", PARIS), ("get_time", {"zone": "CET"})])),
    # mistral (newer): name[ARGS]{...}, one marker per call
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     False, ("", "", [("get_weather", PARIS), ("get_time", {})])),
    # pythonic (LFM2)
    ("lfm2", "<|tool_call_start|>[get_weather(city=\"Paris\", days=2), get_time(zone='UTC')]"
     "<|tool_call_end|>Checking both.", False,
     ("Checking both.", "", [("get_weather", {"city": "Paris", "days": 2}),
                             ("get_time", {"zone": "UTC"})])),
    # our fallback
    ("smollm2", 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
     '</tool_call>', False, ("Sure.", "", [("get_weather", PARIS)])),
    ("smollm2", '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}'
     '</tool_call>', False, ("", "", [("get_time", {"zone": "UTC"})])),
    # Llama 3.1: bare JSON at the start, or after <|python_tag|>, several split by ';'
    ("llama31", ' {"name": "get_weather", "parameters": {"city": "Paris"}}', False,
     ("", "", [("get_weather", PARIS)])),
    ("llama31", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {}}', False,
     ("", "", [("get_weather", PARIS), ("get_time", {})])),
    ("llama31", '{"answer": 42}', False, ('{"answer": 42}', "", [])),
    ("llama31", 'The JSON is {"name": "x", "parameters": {}}', False,
     ('The JSON is {"name": "x", "parameters": {}}', "", [])),
    # unicode arguments stay unescaped
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 🙂"}}\n'
     '</tool_call>', False, ("", "", [("get_weather", {"city": "Zürich 🙂"})])),
    # a call inside the think block (mlx-lm's server does the same): parsed
    ("qwen3", '<think>\nCall it.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
     '</tool_call>\nDone.', False, ("Done.", "Call it.", [("get_time", {})])),
]


@pytest.mark.parametrize("family,text,in_reasoning,expected", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_recorded_outputs(family, text, in_reasoning, expected) -> None:
    assert parse(family, text, in_reasoning=in_reasoning) == expected


def run_raw(family: str, text: str, cut: bool, chunks=None):
    """(text, [(name, arguments as written, problem kind)], problems) of ``text`` fed in
    ``chunks``, ended by the model (``cut`` False) or by ``max_tokens``."""
    p = OutputParser(fmt(family), 0, TOOLS)
    deltas = [d for c in (chunks or [text]) for d in p.feed(c)] + p.finish(cut=cut)
    check_deltas(p, deltas)
    sent = [c for c in p.calls.read if c.id in {d.id for d in deltas
                                                 if isinstance(d, ToolCallStart)}]
    for n, c in enumerate(sent):
        valid = "".join(d.arguments for d in deltas if isinstance(d, ToolCallDelta)
                        and d.call == n and d.valid)
        assert c.arguments.startswith(valid)
    ends = [d for d in deltas if isinstance(d, ToolCallEnd)]
    assert [e.problem for e in ends if e.call >= 0] == [c.problem for c in sent]
    # every call read (those that cannot be run are not the answer's: check_deltas)
    calls = [(c.name, c.arguments, c.problem and c.problem.split(":")[0]) for c in p.calls.read]
    return p.text, calls, [e.problem.split(":")[0] for e in ends if e.problem]


def parse_raw(family: str, text: str, cut: bool = False):
    results = {repr(run_raw(family, text, cut, c)) for c in chunkings(text)}
    assert len(results) == 1, results
    return run_raw(family, text, cut)


# (family, output, ended by the model: (text, calls, problems), cut by max_tokens: the same)
MALFORMED = [
    # a name and arguments that stop being JSON: the call, its arguments as written
    ("qwen25", 'Before <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
     " after", ("Before after", [("get_weather", '{"city": }', "invalid_json")],
                ["invalid_json"]), None),
    ("qwen25", '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
     ("", [("get_time", "[1]}", "invalid_json")], ["invalid_json"]), None),
    # no call in a closed block: its text back, markers included
    ("qwen25", '<tool_call>["not", "a call"]</tool_call>',
     ('<tool_call>["not", "a call"]</tool_call>', [], ["unparsed"]), None),
    ("smollm2", "<tool_call>{}</tool_call>", ("<tool_call>{}</tool_call>", [], ["unparsed"]),
     None),
    ("lfm2", "<|tool_call_start|>[get_weather(city=<|tool_call_end|>",
     ("<|tool_call_start|>[get_weather(city=<|tool_call_end|>", [], ["unparsed"]), None),
    # ended inside a call: before its name, given back when the model ended it, dropped when
    # max_tokens cut it (no partial markup); after its name, the call
    ("qwen25", '<tool_call>\n{"name": "get_time", "argu',
     ('<tool_call>\n{"name": "get_time", "argu', [], ["unparsed"]), ("", [], ["dropped"])),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "argum',
     ('[TOOL_CALLS] [{"name": "get_weather", "argum', [], ["unparsed"]),
     ("", [], ["dropped"])),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
     ("", [("get_weather", '{"city": "Par"}', "invalid_markup")], ["invalid_markup"]),
     ("", [("get_weather", '{"city": "Par', "truncated")], ["truncated"])),
    ("llama31", '{"name": "get_weather", "parameters": {"ci',
     ("", [("get_weather", '{"ci', "invalid_json")], ["invalid_json"]),
     ("", [("get_weather", '{"ci', "truncated")], ["truncated"])),
    # well-formed, but not what was offered
    ("qwen25", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     ("", [("rm_rf", "{}", "unknown_tool")], ["unknown_tool"]), None),
    ("qwen25", '<tool_call>{"name": "get_weather", "arguments": {"days": "two"}}</tool_call>',
     ("", [("get_weather", '{"days": "two"}', "schema")], ["schema"]), None),
]


@pytest.mark.parametrize("family,text,ended,cut", MALFORMED)
def test_malformed_calls(family, text, ended, cut) -> None:
    assert parse_raw(family, text) == ended
    assert parse_raw(family, text, cut=True) == (cut or ended)


def test_partial_markup_never_reaches_the_answer_when_cut() -> None:
    for family, text in (("qwen25", 'Sure.\n<tool'), ("qwen3", "Hi <thi"),
                         ("smollm2", '<tool_call>{"name": "get_time", "arguments": {}}'
                                     '</tool_call>\n<tool_c')):
        got, _, _ = parse_raw(family, text, cut=True)
        assert "<" not in got, (family, got)


def test_raw_control_characters_in_strings_are_passed_on_escaped() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "a\nb"}}</tool_call>'
    _, calls, problems = parse_raw("qwen25", text)
    assert calls == [("get_weather", '{"city": "a\\nb"}', None)] and problems == []


def test_an_unterminated_but_complete_call_is_parsed() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    assert parse("qwen25", text) == ("", "", [("get_weather", PARIS)])


def test_without_tools_markers_are_text() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert parse("qwen25", text, tools=[]) == (text, "", [])


def test_only_what_could_start_a_marker_is_held_back() -> None:
    p = OutputParser(fmt("qwen3"), 0, TOOLS)
    assert p.feed("Hello <tool") == [TextDelta(0, "Hello")]  # " <tool" could be "<tool_call>"
    assert p.feed("box") == [TextDelta(0, " <toolbox")]
    assert p.feed(" and <thi") == [TextDelta(0, " and")]
    assert p.feed("s>") == [TextDelta(0, " <this>")]
    assert p.finish() == [] and p.text == "Hello <toolbox and <this>"


def test_deltas_stream_as_they_come() -> None:
    p = OutputParser(fmt("qwen3"), 1, TOOLS)
    assert p.feed("<think>\nLet") == [ReasoningDelta(1, "Let")]
    assert p.feed(" me see.\n</think>\n\nIt") == [ReasoningDelta(1, " me see."),
                                                  TextDelta(1, "It")]
    out = p.feed(' is.\n<tool_call>\n{"name": "get_time", "arguments": {"zo')
    assert out[0] == TextDelta(1, " is.")
    start, delta = out[1:]
    assert isinstance(start, ToolCallStart) and (start.index, start.call, start.name) == \
        (1, 0, "get_time")
    assert re.fullmatch(r"call_[0-9a-f]{24}", start.id)
    assert delta == ToolCallDelta(1, 0, '{"zo')  # the arguments as the model writes them
    assert p.feed('ne": "U') == [ToolCallDelta(1, 0, 'ne": "U')]
    assert p.feed('TC"') == [ToolCallDelta(1, 0, 'TC"')]
    assert p.feed("}}\n</tool_call>") == [ToolCallDelta(1, 0, "}"), ToolCallEnd(1, 0, None)]
    assert p.tool_calls == [ToolCall(start.id, "get_time", '{"zone": "UTC"}')]


def test_call_ids_are_unique() -> None:
    text = "".join(f'<tool_call>{{"name": "get_time", "arguments": {{"zone": "{i}"}}}}'
                   "</tool_call>" for i in range(20))
    p = OutputParser(fmt("qwen25"), 0, TOOLS)
    p.feed(text)
    p.finish()
    assert len({c.id for c in p.tool_calls}) == 20


def test_the_fallback_format_parses_back_what_render_writes() -> None:
    calls = [ToolCall("a", "get_weather", '{"city": "Zürich", "days": 2}'),
             ToolCall("b", "get_time", "{}")]
    text = "Checking.\n" + "\n".join(fallback_call(c) for c in calls)
    _, _, got = parse("smollm2", text)
    assert got == [(c.name, json.loads(c.arguments)) for c in calls]


def test_in_reasoning_without_think_markers_is_plain_text() -> None:
    assert parse("qwen25", "Just text.", in_reasoning=True) == ("Just text.", "", [])


def test_unknown_tool_names_pass_through() -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse("qwen25", text) == ("", "", [("rm_rf", {})])
    assert OutputParser(fmt("qwen25"), 0, TOOLS).tool_calls == []


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
FIRST_CUT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'


@pytest.mark.parametrize("text, cut, reason, calls, sent", [
    (CALL, False, "tool_calls", 1, 1),
    (CALL + "\n" + CALL.replace("Paris", "Rome"), False, "tool_calls", 2, 2),
    # max_tokens cut a later call (or the start of one): not sent, the answer ends with the
    # complete calls, and says so (a client acts on tool_calls; on length it would drop them)
    (CALL + '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Ro', True,
     "tool_calls", 1, 1),
    (CALL + '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}', True,
     "tool_calls", 2, 2),  # its arguments were whole: a complete call
    (CALL + '\n<tool_call>{"name": "get_wea', True, "tool_calls", 1, 1),
    (CALL + "\n<tool_c", True, "tool_calls", 1, 1),
    (CALL + "\n", True, "tool_calls", 1, 1),
    # the first call cut off: streamed as written, not the answer's; the answer was cut
    (FIRST_CUT, True, "length", 0, 1),
    (CALL + " Then the weather is", True, "length", 1, 1),  # cut in text after the calls
    ("Sure. " + CALL + " Done.", False, "tool_calls", 1, 1),
    ("Just text", True, "length", 0, 0),
    ("Just text", False, "stop", 0, 0),
])
def test_finish_reason_and_what_is_sent(text, cut, reason, calls, sent) -> None:
    for chunks in chunkings(text):
        p = OutputParser(fmt("smollm2"), 0, TOOLS)
        deltas = [d for c in chunks for d in p.feed(c)] + p.finish(cut=cut)
        check_deltas(p, deltas)
        assert p.finish_reason("length" if cut else "stop") == reason, chunks
        assert len(p.tool_calls) == calls and all(runnable(c) for c in p.tool_calls)
        assert len([d for d in deltas if isinstance(d, ToolCallStart)]) == sent, chunks


def test_a_first_call_cut_off_streams_as_written_and_nothing_is_added() -> None:
    p = OutputParser(fmt("smollm2"), 0, TOOLS)
    deltas = p.feed(FIRST_CUT) + p.finish(cut=True)
    args = "".join(d.arguments for d in deltas if isinstance(d, ToolCallDelta))
    assert args == '{"city": "Pa' and deltas[-1] == ToolCallEnd(0, 0, "truncated")
    assert p.tool_calls == [] and [c.problem for c in p.calls.read] == ["truncated"]
