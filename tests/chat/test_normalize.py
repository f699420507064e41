"""Volatile lines: the shipped rules for Claude Code (its attribution header, its 1M-context
label), user rules, off."""

from __future__ import annotations

import pytest

from mlx_kvserver.chat.conversation import Conversation, Message, Text, Tool, ToolResult
from mlx_kvserver.chat.normalize import SHIPPED, Normalizer, load_rules, parse_rule

HEADER = "x-anthropic-billing-header: cc_version=2.1.328.{}; cc_entrypoint=cli;"


def conv(suffix: str, user: str = "hi", extra: str = "") -> Conversation:
    return Conversation(messages=[
        Message("system", [Text(HEADER.format(suffix)), Text("\n\nYou are an agent.")]),
        Message("user", [Text(user)]),
        Message("assistant", [Text(HEADER.format(suffix) + extra)]),
        Message("tool", [ToolResult("c1", HEADER.format(suffix))])])


def test_attribution_header_differing_between_sessions_renders_the_same():
    n = Normalizer()
    a, applied = n.apply(conv("a1f"))
    b, _ = n.apply(conv("9c0"))
    assert applied == ["claude-code-attribution"]
    assert a.messages[0] == b.messages[0]
    assert a.messages[0].text == "\n\nYou are an agent."


def test_claude_code_context_label_of_a_continued_session_renders_the_same():
    """``claude -p`` puts ``(1M context)`` in the co-author line of its Bash tool's
    description and its model id's ``[1m]`` in the system prompt, the ``claude -p -c`` that
    continues it does not (2.1.197): both render the same (tool descriptions are in the system
    prompt); other text stays."""
    line = "When you commit, end the message with:\\nCo-Authored-By: Claude Opus 4.5{} " \
        "<noreply@anthropic.com>\\n- End PR bodies (with care)"

    env = "You are powered by the model named Opus 4.5{}. The exact model ID is " \
        "claude-opus-4-5{}. (claude-opus-4-5 is [1m] fine)"

    def session(label: str, suffix: str) -> Conversation:
        return Conversation([Message("system", [Text(env.format(label, suffix))]),
                             Message("user", [Text("hi")])],
                            tools=[Tool("Bash", line.format(label)), Tool("Read", "")])
    n = Normalizer()
    a, applied = n.apply(session(" (1M context)", "[1m]"))
    b, none = n.apply(session("", ""))
    assert applied == ["claude-code-context-label", "claude-code-model-id-1m"] and none == []
    assert a == b == session("", "")
    assert "(with care)" in a.tools[0].description


def test_rules_never_touch_answers_or_tool_results():
    out, _ = Normalizer().apply(conv("a1f"))
    assert out.messages[2].text == HEADER.format("a1f")
    assert out.messages[3].parts == [ToolResult("c1", HEADER.format("a1f"))]


def test_input_is_not_changed_and_untouched_conversation_is_returned_as_is():
    c = conv("a1f")
    before = c.messages[0].text
    Normalizer().apply(c)
    assert c.messages[0].text == before
    plain = Conversation(messages=[Message("user", [Text("no header here")])])
    assert Normalizer().apply(plain) == (plain, [])


def test_user_rules_with_replacement_and_from_a_file(tmp_path):
    rule = parse_rule(r"request #\d+=>request #N", "cli")
    c = Conversation(messages=[Message("user", [Text("request #41\nToday is Monday.")])])
    out, applied = Normalizer([rule]).apply(c)
    assert out.messages[0].text == "request #N\nToday is Monday." and applied == ["cli"]
    f = tmp_path / "rules.txt"
    f.write_text("# comment\n\n^Today is .*$=>Today is <date>.\n")
    (r,) = load_rules(f)
    out, applied = Normalizer([r]).apply(c)
    assert out.messages[0].text == "request #41\nToday is <date>."
    assert applied == [f"{f}:3"]


def test_off_means_no_rules_at_all():
    n = Normalizer.from_config(False, ["x"], [])
    assert n.rules == ()
    c = conv("a1f")
    assert n.apply(c) == (c, [])
    assert Normalizer.from_config(True, [], []).rules == SHIPPED


def test_bad_rule_is_a_clear_error():
    with pytest.raises(ValueError, match="not a regular expression"):
        parse_rule("([", "cli")
    with pytest.raises(ValueError, match="empty"):
        parse_rule("=>x", "cli")
