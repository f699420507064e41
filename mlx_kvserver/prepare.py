"""The next turn, prepared while the engine is idle.

Some chat templates render an answer one way while it is the newest message and another way once
the conversation moves on: Qwen3-style thinking templates drop the reasoning of answers before
the last user message. The tokens the engine holds for that answer (reasoning included) are then
not a prefix of the next turn's prompt, and the next turn would read the whole answer again, and
everything after it on every later turn of a thinking model.

After such an answer, :func:`next_turn_tokens` renders the history as the next turn will render
it (the answer followed by a placeholder message of the kind that comes next: a user message, or
a tool result when the answer called tools) and keeps the tokens up to the placeholder. When they
differ from what the engine holds, the scheduler runs them as a :class:`Prepare` while it has
nothing else to do, and saves them as an entry of their own: the next turn then finds its prefix
(by content, in memory or on disk) and reads only its new message.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kv_cache import PagedSequence

from .chat.conversation import Message, Reasoning, Text, ToolResult
from .chat.output import Finish
from .chat.render import render

_A, _B = "\ue000", "\ue001"  # placeholders: private-use characters no client text relies on


def prepared_key(message_id: str) -> str:
    """The entry key of the prepared next turn after the answer ``message_id`` (a control
    character keeps it apart from every client id, which may hold none)."""
    return f"\x00next:{message_id}"


def next_turn_tokens(request, finish: Finish, held: list[int]) -> list[int] | None:
    """The tokens the next turn's prompt will start with, when they are not already a prefix of
    ``held`` (the prompt and answer the engine holds); None when nothing needs preparing."""
    conv, lm = request.conversation, request.lm
    fmt = request.support.format
    if not fmt.think_start or not finish.reasoning or conv.prompt is not None:
        return None
    answer = Message("assistant", [Reasoning(finish.reasoning)] +
                     ([Text(finish.text)] if finish.text else []) + list(finish.tool_calls))
    texts = []
    for mark in (_A, _B):
        nxt = Message("tool", [ToolResult(finish.tool_calls[0].id, mark)]) \
            if finish.tool_calls else Message("user", [Text(mark)])
        later = replace(conv, messages=[*conv.messages, answer, nxt], continue_final=False)
        texts.append(render(lm.tokenizer, fmt, later).text)
    a, b = texts
    cut = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if cut is None:
        return None
    tokens = lm.tokenizer.encode(a[:cut])[:-1]  # the last token may merge with what follows
    n = 0
    for x, y in zip(tokens, held):
        if x != y:
            break
        n += 1
    if n == len(tokens):
        return None  # the held tokens already begin the next turn
    return tokens


@dataclass
class Prepare:
    """A next turn being read while the engine is idle: ``tokens`` saved under ``key``."""

    tokens: list[int]
    key: str
    seq: PagedSequence | None = None
    done: int = 0
    keys: list[str] = field(default_factory=list)  # where its prefix may be found
