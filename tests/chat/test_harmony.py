"""gpt-oss's Harmony output parsed as it streams (mlx_kvserver/chat/harmony.py): the corpus of
real and documented outputs in every chunking, token by token through the tokenizer, the texts
the model's own template renders, and bad output (which never raises)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mlx_kvserver.chat.conversation import Conversation, Message, Reasoning, Text, Tool, ToolCall
from mlx_kvserver.chat.harmony import MAX_HEADER, HarmonyParser
from mlx_kvserver.chat.output import (ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd,
                                      ToolCallStart)
from mlx_kvserver.chat.render import render
from mlx_kvserver.chat.support import ChatSupport
from tests.chat.corpus.load import load
from tests.chat.templates import make_chat_tokenizer
from tests.chat.test_corpus import check_deltas, chunkings, tools_of

SAMPLES = load("gpt_oss")["samples"]
WEATHER = Tool("get_weather", "Weather", {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]})
ENDS = ("<|call|>", "<|return|>")


def run(chunks: list[str], tools=(WEATHER,), cut: bool = False, **kw):
    """(parser, deltas), checking that the deltas add up to what the parser reports."""
    p = HarmonyParser(0, list(tools), **kw)
    deltas = [d for c in chunks for d in p.feed(c)] + p.finish(cut=cut)
    check_deltas(p, deltas)
    return p, deltas


def calls(p: HarmonyParser) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in p.tool_calls]


@pytest.fixture(scope="module")
def tok():
    return make_chat_tokenizer("gpt_oss")


@pytest.mark.parametrize("i", range(len(SAMPLES)))
@pytest.mark.parametrize("fed_end", [True, False], ids=["end-fed", "end-not-fed"])
def test_corpus_sample_in_every_chunking(i: int, fed_end: bool) -> None:
    """Exactly the expected content, reasoning and calls (with no problem), whether the final
    <|call|>/<|return|> is fed or, as the engine does with end tokens, not."""
    sample = SAMPLES[i]
    text, want = sample["text"], sample["expect"]
    if not fed_end:
        text = next((text[:-len(e)] for e in ENDS if text.endswith(e)), text)
    for n, chunks in enumerate(chunkings(text, seed=i)):
        p, _ = run(chunks, tools_of(sample))
        assert (p.text, p.reasoning) == (want["content"], want["reasoning"]), n
        assert calls(p) == [(c["name"], c["arguments"]) for c in want["tool_calls"]], n
        assert [c.problem for c in p.tool_calls if c.problem] == [], n


def test_token_by_token_the_header_never_reaches_the_answer(tok) -> None:
    text = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant'
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Paris"}')
    decoder, p = tok.stream_decoder(skip_special_tokens=False), HarmonyParser(0, [WEATHER])
    seen, flags = [], []
    for t in tok.encode(text):
        for d in p.feed(decoder.add(t)):
            seen.append(d)
        flags.append(p.in_reasoning)
    seen += p.finish()
    assert p.reasoning == "Need the weather." and p.text == ""
    assert [type(d) for d in seen if not isinstance(d, ToolCallDelta)][-3:] == \
        [ReasoningDelta, ToolCallStart, ToolCallEnd]
    assert sum(isinstance(d, ReasoningDelta) for d in seen) > 3  # streamed, not at its end
    assert sum(isinstance(d, ToolCallDelta) for d in seen) > 3
    assert calls(p) == [("get_weather", {"city": "Paris"})]
    # reasoning from <|message|> of the analysis to its <|end|>, and nowhere else
    assert flags[0] is False and True in flags and flags[-1] is False
    head = len(tok.encode("<|channel|>analysis<|message|>"))
    assert flags.index(True) == head - 1  # from its <|message|> token
    assert flags.count(True) == 1 + len(tok.encode("Need the weather."))


def test_call_starts_when_its_header_ends() -> None:
    p = HarmonyParser(0, [WEATHER])
    head = "<|channel|>commentary to=functions.get_weather <|constrain|>json"
    assert p.feed(head) == []  # a header passes nothing on
    out = p.feed("<|message|>")
    assert [type(d) for d in out] == [ToolCallStart] and out[0].name == "get_weather"


def test_texts_the_template_renders_parse_back(tok) -> None:
    """What gpt-oss's template renders for an answer is read back as that answer."""
    fmt = ChatSupport(SimpleNamespace(tokenizer=tok, model=None)).format
    user = Message("user", [Text("Weather in Paris?")])
    call = ToolCall("c1", "get_weather", '{"city": "Paris"}')
    answers = [Message("assistant", [Reasoning("I will check."), call]),
               Message("assistant", [Text("It is sunny.")])]
    for answer in answers:
        before = render(tok, fmt, Conversation(messages=[user], tools=[WEATHER])).text
        after = render(tok, fmt, Conversation(messages=[user, answer], tools=[WEATHER])).text
        assert after.startswith(before)
        p, _ = run(list(after[len(before):]))  # ends with the next <|start|>assistant
        assert (p.reasoning, p.text) == (answer.reasoning, answer.text)
        assert [(c.name, c.arguments) for c in p.tool_calls] == \
            [(c.name, c.arguments) for c in answer.tool_calls]


def test_preamble_and_final_are_answer_text_and_to_assistant_is_no_tool() -> None:
    p, _ = run(["<|channel|>commentary<|message|>Checking.<|end|>",
                "<|start|>assistant<|channel|>commentary to=assistant<|message|>Still here.",
                "<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>"])
    assert p.text == "Checking.\n\nStill here.\n\nDone." and p.tool_calls == []


def test_without_tools_a_recipient_is_no_call() -> None:
    p, _ = run(['<|channel|>analysis to=python code<|message|>print(1)<|end|>'
                '<|start|>assistant<|channel|>final<|message|>1'], tools=())
    assert (p.reasoning, p.text, p.tool_calls) == ("print(1)", "1", [])


def test_output_that_starts_with_no_header_is_the_final_text() -> None:
    """A continued final message (Anthropic's prefill): ' to' could begin a header until the
    next character says it does not."""
    p = HarmonyParser(0, [WEATHER])
    assert p.feed(" to") == []
    assert p.feed("morrow") == [TextDelta(0, " tomorrow")]
    p.feed(" it rains.<|end|><|start|>assistant<|channel|>final<|message|>Bye")
    p.finish()
    assert p.text == " tomorrow it rains.\n\nBye"


def test_cut_by_max_tokens() -> None:
    p, _ = run(['<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Par'], cut=True)
    assert [(c.name, c.problem) for c in p.calls.read] == [("get_weather", "truncated")]
    assert p.tool_calls == [] and p.finish_reason("length") == "length"  # not a call to run
    p, deltas = run(["<|channel|>final<|message|>Hello <|e"], cut=True)
    assert p.text == "Hello "  # a marker's start is dropped
    p, deltas = run(["<|channel|>final<|message|>Hi<|end|><|start|>assistant<|channel|>fi"],
                    cut=True)
    assert p.text == "Hi" and len(deltas) == 1  # a header is dropped


def test_bad_output_is_reported_never_raised() -> None:
    head = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"
    p, _ = run(["<|channel|>analysis<|message|>x<|end|>", head.format("get_weather"),
                "print('hi')<|call|>"])
    (c,) = p.calls.read
    assert c.arguments == "print('hi')" and c.problem.startswith("invalid_json")
    assert p.tool_calls == []  # not JSON: not a call of the answer
    p, _ = run([head.format("nope")[len("<|start|>assistant"):], '{"a": 1}'])
    assert p.tool_calls[0].problem.startswith("unknown_tool")
    p, _ = run([head.format("get_weather")[len("<|start|>assistant"):], "<|call|>"])
    assert p.calls.read[0].problem == "invalid_json: no arguments" and p.tool_calls == []
    p, _ = run(["<|channel|>" + "x" * MAX_HEADER + " and on"])
    assert p.text.startswith("<|channel|>xxx") and p.text.endswith(" and on")


def test_a_message_of_another_author_ends_the_answer() -> None:
    p = HarmonyParser(0, [WEATHER])
    p.feed("<|channel|>final<|message|>Hi<|end|><|start|>user<|message|>more")
    assert p.ended and p.text == "Hi"


def test_parallel_off_ends_after_the_first_call() -> None:
    head = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    p = HarmonyParser(0, [WEATHER], parallel=False)
    p.feed(head + '{"city": "A"}<|end|><|start|>assistant' + head + '{"city": "B"}')
    assert p.ended and calls(p) == [("get_weather", {"city": "A"})]


def test_prompt_ending_inside_analysis() -> None:
    p, _ = run(["more thought<|end|><|start|>assistant<|channel|>final<|message|>ok"],
               in_reasoning=True)
    assert (p.reasoning, p.text) == ("more thought", "ok")


def test_support_gives_the_harmony_parser(tok) -> None:
    support = ChatSupport(SimpleNamespace(tokenizer=tok, model=None))
    assert support.format.harmony and support.markers_special
    assert isinstance(support.output_parser(0, [WEATHER], False, True), HarmonyParser)
