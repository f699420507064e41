"""Real outputs of each model family (tests/chat/corpus/, each sample with its source) through the
family's parser, fed whole, by character and in random chunks: the answer text, the reasoning
and the tool calls (name and arguments) must be the sample's expected ones whatever the
chunking, and every call's argument deltas must add up to its arguments. Whitespace runs in the
answer and the reasoning compare as one space (where text meets markup, sources differ on what
they keep); arguments compare exactly.

The families' formats are the ones :func:`mlx_kvserver.chat.formats.detect` gives their templates
(tests/chat/test_formats.py checks the detection where a template is at hand); gpt-oss's Harmony
has its own parser (tests/chat/test_harmony.py runs its corpus).
"""

from __future__ import annotations

import json
import random

import pytest

from mlx_kvserver.chat.call_events import runnable
from mlx_kvserver.chat.conversation import Tool
from mlx_kvserver.chat.formats import ChatFormat, format_for
from mlx_kvserver.chat.output import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallStart
from mlx_kvserver.chat.parse import OutputParser
from tests.chat.corpus.load import families, load

# family -> (tool parser, think markers)
FORMATS = {
    "qwen3": ("json_tools", ("<think>", "</think>")),
    "qwen3_coder": ("qwen3_coder", None),
    "qwen3_5": ("qwen3_coder", ("<think>", "</think>")),
    "glm45": ("glm47", ("<think>", "</think>")),
    "glm47": ("glm47", ("<think>", "</think>")),
    "gemma4": ("gemma4", ("<|channel>thought", "<channel|>")),
    "minimax_m2": ("minimax_m2", ("<think>", "</think>")),
    "kimi_k2": ("kimi_k2", ("<think>", "</think>")),
    "mistral": ("mistral", ("[THINK]", "[/THINK]")),
    "llama3": ("llama3_json", None),
    "deepseek_v3": ("deepseek_v3", ("<think>", "</think>")),
}
FALLBACK_TOOL = {"type": "object", "properties": {}}


def chat_format(family: str) -> ChatFormat:
    parser, think = FORMATS[family]
    return format_for(parser, think, python_tag=family == "llama3")


def tools_of(sample: dict) -> list[Tool]:
    """The sample's tools, and a permissive one for every other name it calls."""
    out = [Tool(t["function"]["name"], t["function"].get("description", ""),
                t["function"].get("parameters") or FALLBACK_TOOL)
           for t in sample.get("tools") or []]
    named = {t.name for t in out}
    for c in sample["expect"]["tool_calls"]:
        if c["name"] not in named:
            out.append(Tool(c["name"], "", FALLBACK_TOOL))
            named.add(c["name"])
    return out or [Tool("unused", "", FALLBACK_TOOL)]


def run(family: str, sample: dict, chunks: list[str]):
    p = OutputParser(chat_format(family), 0, tools_of(sample),
                     in_reasoning=sample.get("prompt_ends_in_reasoning", False))
    check_deltas(p, [d for c in chunks for d in p.feed(c)] + p.finish())
    calls = [{"name": c.name, "arguments": json.loads(c.arguments)} for c in p.tool_calls]
    problems = [c.problem for c in p.tool_calls if c.problem]
    return {"content": _ws(p.text), "reasoning": _ws(p.reasoning), "tool_calls": calls}, problems


def check_deltas(p, deltas: list) -> None:
    """The deltas of parser ``p`` add up to the text, reasoning and calls it reports."""
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == p.text
    assert "".join(d.text for d in deltas if isinstance(d, ReasoningDelta)) == p.reasoning
    starts = [d for d in deltas if isinstance(d, ToolCallStart)]
    sent = [c for c in p.calls.read if c.id in {s.id for s in starts}]  # in the stream's order
    assert [(s.call, s.id, s.name) for s in starts] == \
        [(n, c.id, c.name) for n, c in enumerate(sent)]
    for s, c in zip(starts, sent):
        assert "".join(d.arguments for d in deltas if isinstance(d, ToolCallDelta)
                       and d.call == s.call) == c.arguments
    # the answer's calls: every call read that can be run (each one sent)
    assert p.tool_calls == [c for c in p.calls.read if runnable(c)]
    assert all(c in sent for c in p.tool_calls)


def _ws(text: str) -> str:
    """Whitespace where text meets markup is the server's to drop or keep: compared as one
    space (the text itself, and every argument, exactly)."""
    return " ".join(text.split())


def chunkings(text: str, seed: int):
    yield [text]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(12):
        k = min(len(text) - 1, rng.randint(1, 24))
        cuts = sorted(rng.sample(range(1, len(text)), k)) if k > 0 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


SAMPLES = [(f, i) for f in families() if f in FORMATS for i in range(len(load(f)["samples"]))]


@pytest.mark.parametrize("family,i", SAMPLES, ids=[f"{f}-{i}" for f, i in SAMPLES])
def test_corpus_sample(family: str, i: int) -> None:
    sample = load(family)["samples"][i]
    want = {**sample["expect"], "content": _ws(sample["expect"]["content"]),
            "reasoning": _ws(sample["expect"]["reasoning"])}
    for n, chunks in enumerate(chunkings(sample["text"], seed=i)):
        got, problems = run(family, sample, chunks)
        assert got == want, (sample["source"], n)
        assert problems == [], (sample["source"], problems)


def test_every_family_of_the_issue_has_a_corpus() -> None:
    assert set(FORMATS) | {"gpt_oss"} <= set(families())
    for f in families():
        assert len(load(f)["samples"]) >= 3, f
