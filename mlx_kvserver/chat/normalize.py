"""Volatile lines: text that changes from request to request and means nothing to the model.

A coding agent may put a line near the head of its prompt that differs per request (an
attribution or billing header, a request counter). Everything after it then renders to other
tokens, and the KV cache can reuse nothing past it. A rule here rewrites such a line to a stable
form before the conversation is rendered, so the prompt's tokens stay the same from request to
request and the cache holds.

A rule is a regular expression (Python syntax, matched per line with ``re.MULTILINE``) and a
replacement (``\\1`` groups allowed; empty: the matched text is removed). The shipped rules:

- ``claude-code-attribution``: Claude Code's first system block,
  ``x-anthropic-billing-header: cc_version=<version>.<suffix>; cc_entrypoint=<name>;`` whose
  suffix differs between sessions and kinds of request. The whole line is billing metadata for
  Anthropic's servers; it is removed. With it, two sessions in one project share the ~18,000
  tokens of tools and system prompt that follow; without it, about their first ten tokens.
- ``claude-code-context-label`` and ``claude-code-model-id-1m``: the ``(1M context)`` label
  and the ``[1m]`` suffix of the model id, which Claude Code (2.1.197, tried) writes into its
  system prompt (``You are powered by the model named ... (1M context). The exact model ID is
  claude-...[1m].``) and its Bash tool's commit co-author line in a ``claude -p`` session and
  not in the ``claude -p -c`` that continues it: that continuation read 965 of its 22,654 prompt
  tokens from the cache, the label's position. Both are removed (the served model is not that
  one anyway).

User rules come from ``--volatile-rule 'REGEX'`` (removes matches) or ``--volatile-rule
'REGEX=>REPLACEMENT'``, and from ``--volatile-rules FILE`` (one rule a line in the same form;
blank lines and lines starting with ``#`` are skipped). ``--no-volatile-rules`` turns all of
them off, the shipped one included. The server logs each request that a rule changed.

Rules apply to text parts of system and developer messages and of the first user message (where
agents put environment facts) and to tools' descriptions (rendered into the system prompt by
most templates), never to the answer's own history, tool calls or tool results.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path

from .conversation import Conversation, Text

log = logging.getLogger("mlx_kvserver.chat")

SEPARATOR = "=>"


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern
    replacement: str = ""


SHIPPED = (
    Rule("claude-code-attribution",
         re.compile(r"^x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE)),
    Rule("claude-code-context-label", re.compile(r" \(1M context\)")),
    Rule("claude-code-model-id-1m", re.compile(r"\b(claude-[\w.-]+)\[1m\]"), r"\1"),
)


def parse_rule(text: str, name: str) -> Rule:
    """A rule from ``REGEX`` or ``REGEX=>REPLACEMENT``; ValueError for a bad expression."""
    pattern, sep, replacement = text.partition(SEPARATOR)
    if not pattern:
        raise ValueError(f"volatile rule {name}: empty expression")
    try:
        compiled = re.compile(pattern, re.MULTILINE)
    except re.error as e:
        raise ValueError(f"volatile rule {name}: {pattern!r} is not a regular expression: {e}")
    return Rule(name, compiled, replacement if sep else "")


def load_rules(path: Path) -> list[Rule]:
    rules = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            rules.append(parse_rule(line.rstrip("\n"), f"{path}:{n}"))
    return rules


class Normalizer:
    """Applies the rules to a conversation (a new one; the input is left unchanged)."""

    def __init__(self, rules: list[Rule] | tuple[Rule, ...] = SHIPPED):
        self.rules = tuple(rules)

    @classmethod
    def from_config(cls, enabled: bool, rules: list[str], files: list[Path]) -> "Normalizer":
        if not enabled:
            return cls(())
        extra = [parse_rule(r, f"--volatile-rule {i + 1}") for i, r in enumerate(rules)]
        for f in files:
            extra += load_rules(f)
        return cls((*SHIPPED, *extra))

    def apply(self, conv: Conversation) -> tuple[Conversation, list[str]]:
        """``conv`` with volatile lines rewritten, and the names of the rules that applied."""
        if not self.rules or not conv.messages:
            return conv, []
        applied: list[str] = []
        first_user = next((i for i, m in enumerate(conv.messages) if m.role == "user"), None)
        messages = list(conv.messages)
        for i, m in enumerate(messages):
            if m.role not in ("system", "developer") and i != first_user:
                continue
            parts, changed = [], False
            for p in m.parts:
                if isinstance(p, Text):
                    text = self._rewrite(p.text, applied)
                    changed |= text != p.text
                    p = Text(text) if text != p.text else p
                parts.append(p)
            if changed:
                messages[i] = replace(m, parts=parts)
        tools = [replace(t, description=self._rewrite(t.description, applied))
                 if t.description else t for t in conv.tools]
        if not applied:
            return conv, []
        return replace(conv, messages=messages, tools=tools), sorted(set(applied))

    def _rewrite(self, text: str, applied: list[str]) -> str:
        for rule in self.rules:
            new, count = rule.pattern.subn(rule.replacement, text)
            if count:
                applied.append(rule.name)
                text = new
        return text
