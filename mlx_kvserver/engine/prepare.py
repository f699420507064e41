"""The next turn, prepared while the engine is idle.

Some chat templates render an answer one way while it is the newest message and another way once
the conversation moves on: Qwen3-style thinking templates drop the reasoning of answers before
the last user message; gpt-oss's Harmony template drops the analysis once a final answer
follows, and writes a call's header otherwise than the model does. The tokens the engine holds
for that answer (reasoning included) are then not a prefix of the next turn's prompt, and the
next turn would read the whole answer again, and everything after it on every later turn of a
thinking model.

After such an answer, :func:`next_turn_tokens` renders the history as the next turn will render
it (the answer followed by a placeholder message of the kind that comes next: a user message, or
a tool result when the answer called tools) and keeps the tokens up to the placeholder. When they
differ from what the engine holds, the scheduler runs them as a :class:`Prepare` while it has
nothing else to do, and saves them as an entry of their own: the next turn then finds its prefix
(by content, in memory or on disk) and reads only its new message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from kv_cache import CacheManager, OutOfBlocksError
from kv_cache.hooks import PagedSequence

from ..chat.conversation import Message, Reasoning, Text, ToolResult
from ..chat.output import Finish
from ..chat.render import render

_A, _B = "\ue000", "\ue001"  # placeholders: private-use characters no client text relies on

log = logging.getLogger("mlx_kvserver.engine")

MAX_PREPARES = 8


def prepared_key(message_id: str) -> str:
    """The entry key of the prepared next turn after the answer ``message_id`` (a control
    character keeps it apart from every client id, which may hold none)."""
    return f"\x00next:{message_id}"


def next_turn_tokens(request, finish: Finish, held: list[int]) -> list[int] | None:
    """The tokens the next turn's prompt will start with, when they are not already a prefix of
    ``held`` (the prompt and answer the engine holds); None when nothing needs preparing."""
    conv, lm = request.conversation, request.lm
    fmt = request.support.format
    if conv.prompt is not None or not _may_change(fmt, conv.messages, finish):
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


def _may_change(fmt, messages: list[Message], finish: Finish) -> bool:
    """Whether the template may render this turn otherwise next turn: a thinking template drops
    reasoning; gpt-oss's drops the analysis of the turn's calls once a final answer follows,
    and writes a call's header otherwise than the model does."""
    if fmt.harmony:
        if finish.reasoning or finish.tool_calls:
            return True
        last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
        return any(m.reasoning for m in messages[last_user + 1:])
    return bool(fmt.think_start and finish.reasoning)


@dataclass
class Prepare:
    """A next turn being read while the engine is idle: ``tokens`` saved under ``key``."""

    tokens: list[int]
    key: str
    seq: PagedSequence | None = None
    done: int = 0
    keys: list[str] = field(default_factory=list)  # where its prefix may be found


class NextTurns:
    """The prepared next turns, oldest first: at most ``MAX_PREPARES`` (a new one pushes the
    oldest out), read one chunk per idle step. They only ever use spare time and spare pages, so
    the scheduler drops them whenever a request needs the room (``clear``)."""

    def __init__(self, manager: CacheManager, runner, prefill_chunk: int):
        self.manager, self.runner, self.prefill_chunk = manager, runner, prefill_chunk
        self.queue: list[Prepare] = []

    def __len__(self) -> int:
        return len(self.queue)

    def plan(self, c) -> None:
        """Queue the next turn after the answer of choice ``c`` when it needs preparing."""
        r = c.request
        try:
            tokens = next_turn_tokens(r, c.finish_event(), r.prompt + c.tokens)
        except Exception as e:  # a template that cannot render the next turn: nothing to do
            log.info("%s: next turn not prepared: %s", r.id, e)
            return
        if tokens is not None:
            self.queue.append(Prepare(tokens, prepared_key(c.message_id), keys=[c.message_id]))
            del self.queue[:-MAX_PREPARES]

    def step(self) -> None:
        """One chunk of the oldest prepared next turn; saved once read."""
        p = self.queue[0]
        try:
            if p.seq is None:
                p.seq, match = self.manager.start(p.tokens, p.keys, use_cache=True)
                p.done = match.tokens
            piece = p.tokens[p.done : p.done + self.prefill_chunk]
            self.runner.prefill(p.seq, piece, logits=False)  # its caches only
            self.manager.with_room(p.seq.commit)
            p.done += len(piece)
            if p.done == len(p.tokens):
                self.manager.save(p.key, p.seq)
                log.info("next turn prepared: %d tokens saved as %s", p.done, p.key[1:])
                # kept resident: the next turn goes on from it in memory, its open last page
                # included (by content alone, memory finds full pages only, and the disk's copy
                # of that page may still be on its way)
                seq, p.seq = p.seq, None
                self.manager.keep(seq)
                self._drop_oldest()
        except OutOfBlocksError:  # the cache is full: the next turn reads its history itself
            self._drop_oldest()
        except Exception:
            log.exception("preparing a next turn failed")
            self._drop_oldest()

    def clear(self) -> None:
        """Drop every prepared next turn, freeing the pages of the one being read."""
        while self.queue:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        p = self.queue.pop(0)
        if p.seq is not None:
            p.seq.close()
