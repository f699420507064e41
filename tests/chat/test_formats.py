"""ChatFormat detection from real templates and tiny tokenizers (tests/chat/templates.py)."""

from __future__ import annotations

import pytest

from mlx_kvserver.chat.formats import ChatFormat, detect
from tests.chat.templates import make_chat_tokenizer

# family: (tool_parser, call_start, call_end, native_tools, think, thinking_kwarg, payload, special)
EXPECTED = {
    "qwen25": ("json_tools", "<tool_call>", "</tool_call>", True, None, None, "json", False),
    "qwen3": ("json_tools", "<tool_call>", "</tool_call>", True, "<think>", "enable_thinking",
              "json", False),
    "qwen3_coder": ("qwen3_coder", "<tool_call>", "</tool_call>", True, None, None, None, False),
    "llama31": ("llama3_json", "<|python_tag|>", None, True, None, None, None, True),
    "mistral": ("mistral", "[TOOL_CALLS]", None, True, None, None, None, True),
    "lfm2": ("pythonic", "<|tool_call_start|>", "<|tool_call_end|>", True, None, None, None,
             True),
    "smollm2": ("fallback", "<tool_call>", "</tool_call>", False, None, None, "json", False),
    # Harmony: headers, not markers; its template's `"thinking" in message` switches nothing
    "gpt_oss": ("harmony", None, None, True, None, None, "json", True),
}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_detect(family: str) -> None:
    f = detect(make_chat_tokenizer(family))
    parser, start, end, native, think, kwarg, payload, special = EXPECTED[family]
    assert (f.tool_parser, f.call_start, f.call_end, f.native_tools) == (parser, start, end,
                                                                          native)
    assert f.think_start == think and f.think_end == (think and think.replace("<", "</"))
    assert (f.thinking_kwarg, f.call_payload, f.markers_special) == (kwarg, payload, special)


def test_markers_special_means_a_plain_decode_drops_them() -> None:
    # Qwen's <think>/<tool_call> are added tokens that are not special: a plain decode keeps
    # them; Mistral's [TOOL_CALLS] is special: only a decode that keeps special tokens shows it.
    for family, marker in (("qwen3", "<think>"), ("qwen3", "<tool_call>"),
                           ("mistral", "[TOOL_CALLS]")):
        tok = make_chat_tokenizer(family)
        ids = tok.encode(f"a{marker}b")
        assert len(tok.encode(marker)) == 1
        kept = tok.decode(ids) == f"a{marker}b"
        assert kept == (not detect(tok).markers_special)
        assert tok.decode(ids, skip_special_tokens=False) == f"a{marker}b"


def test_a_template_without_tools_gets_the_fallback_even_with_a_known_vocab() -> None:
    # Qwen3's vocabulary and markers but a template that renders no tools: the model is told
    # our format, so our format is what is parsed.
    tok = make_chat_tokenizer("qwen3", template=make_chat_tokenizer("smollm2").chat_template)
    f = detect(tok)
    assert (f.tool_parser, f.native_tools, f.call_start) == ("fallback", False, "<tool_call>")
    assert f.think_start == "<think>"  # still a thinking vocabulary


def test_a_template_that_raises_on_the_probe_falls_back_to_its_source() -> None:
    tok = make_chat_tokenizer("smollm2", template="{{ raise_exception('no') }}")
    assert detect(tok) == ChatFormat()  # the fallback, nothing else known
    assert ChatFormat().markers == ("<tool_call>", "</tool_call>")
