"""Why a turn read tokens again: where its prompt first differs from a history the engine held.

An agent's turn should read only its new messages. When it reads more, something earlier in the
prompt changed: a line near the head that differs per request, a template that renders an
earlier answer otherwise, a client that rewrote its history. The scheduler keeps the token ids
of the last answered turns (:class:`RecentTurns`); a new prompt that shares a prefix with one of
them, differs from it before its end, and still holds its last tokens further on (the same
history, changed inside, not another conversation) is a re-read: :class:`Divergence` says at
which token and message, with a short excerpt of both sides, and how many tokens it re-reads.
"""

from __future__ import annotations

import logging
from array import array
from collections import deque
from dataclasses import replace

from kv_cache.hooks import common_prefix

from ..chat.output import Divergence
from ..chat.render import render

log = logging.getLogger("mlx_kvserver.engine")

KEEP = 32  # turns remembered per model
TAIL = 16  # a held history's last ids, looked for in the new prompt after the difference
EXCERPT = 40  # characters of each side shown


def _ids(tokens) -> bytes:
    return array("q", tokens).tobytes()


class RecentTurns:
    """The token ids (prompt and answer) of the last ``KEEP`` answered turns of one model, with
    the length of their prompt."""

    def __init__(self, keep: int = KEEP):
        self.turns: deque[tuple[list[int], int]] = deque(maxlen=keep)
        self.reread = {"tokens": 0, "turns": 0, "last": None}  # for the cache stats

    def add(self, tokens: list[int], prompt_len: int) -> None:
        self.turns.append((tokens, prompt_len))

    def diagnose(self, request) -> Divergence | None:
        """Where ``request``'s prompt differs from a history held before it, counted in
        ``reread`` and logged; None where it does not, or where that cannot be said (a diagnosis
        never fails a request)."""
        found = self.find(request.prompt)
        if found is None:
            return None
        try:
            d = explain(request, *found)
            self.reread.update(tokens=self.reread["tokens"] + d.reread_tokens,
                               turns=self.reread["turns"] + 1, last=d.as_dict())
        except Exception:
            log.exception("%s: could not explain the re-read", request.id)
            return None
        log.info("%s re-reads %d tokens: its prompt differs at token %d (message %s) from a "
                 "history held before: %r, was %r", request.id, d.reread_tokens, d.position,
                 d.message_index, d.prompt_excerpt, d.cached_excerpt)
        return d

    def find(self, prompt: list[int]) -> tuple[list[int], int] | None:
        """The held history the prompt diverges from (and where), or None: none shares a
        prefix and then reappears after a difference."""
        best: tuple[list[int], int] | None = None
        blob = None
        for held, plen in self.turns:
            n = common_prefix(prompt, held)
            if n >= len(held) or n >= len(prompt) - 1 or (best and n <= best[1]):
                continue  # the prompt goes on from it (or ends): nothing re-read
            # NOTE: the held prompt's last words, before its answer's role header: an answer's
            # ids re-encoded from its text need not be the ids it was sampled as
            end = max(n + 1, plen - 4)
            tail = held[max(n + 1, end - TAIL):end]
            if not tail:
                continue
            blob = blob if blob is not None else _ids(prompt)
            at = blob.find(_ids(tail), (n + 1) * 8)
            if at >= 0 and at % 8 == 0:
                best = (held, n)
        return best


def explain(request, held: list[int], position: int) -> Divergence:
    """The :class:`Divergence` of ``request``'s prompt from ``held`` at ``position``."""
    tok = request.lm.tokenizer
    prompt = request.prompt

    def excerpt(ids: list[int]) -> str:
        text = tok.decode(ids[position:position + 24], skip_special_tokens=False)
        return text[:EXCERPT]
    return Divergence(position, _message_at(request, position), excerpt(prompt), excerpt(held),
                      len(held) - position)


def _message_at(request, position: int) -> int | None:
    """The index of the message whose rendering holds prompt token ``position`` (a binary
    search over rendered prefixes of the history; None where a prefix does not render)."""
    conv = request.conversation
    if conv.prompt is not None or not conv.messages:
        return None
    tok, fmt = request.lm.tokenizer, request.support.format
    offset = len(tok.decode(request.prompt[:position], skip_special_tokens=False))
    lo, hi = 0, len(conv.messages)  # the answer is the smallest k whose prefix passes offset
    try:
        while lo < hi:
            mid = (lo + hi) // 2
            part = replace(conv, messages=conv.messages[:mid + 1], continue_final=True) \
                if conv.messages[mid].role == "assistant" else \
                replace(conv, messages=conv.messages[:mid + 1], continue_final=False)
            if len(render(tok, fmt, part).text) > offset:
                hi = mid
            else:
                lo = mid + 1
    except Exception:  # a template that refuses a partial history
        return None
    return lo if lo < len(conv.messages) else None
