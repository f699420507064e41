"""Tokenizing rendered prompts piece by piece, reusing the pieces earlier prompts had.

A Hugging Face tokenizer cuts its input at its added tokens (``<|im_start|>``, ``<|im_end|>``,
``<tool_call>`` ...) before it normalizes, pre-tokenizes or merges anything, so a prompt's ids
are the ids of each piece between added tokens, concatenated, with the added tokens' own ids
between them. An agent re-sends its whole history every turn (Claude Code: ~25,000 tokens of
tools and system prompt, then the turns): rendered, all but the last few pieces are the text of
the previous turn's pieces, so only the new pieces need tokenizing (at 24,000 tokens, ~90 ms a
turn for the whole prompt on a 2-core x86 machine against a few ms for the new pieces).

That holds only for tokenizers whose added tokens match as plain strings (no ``lstrip``,
``rstrip``, ``single_word``, no matching after a normalizer) and whose pre-tokenizer treats every
piece alike (a Metaspace ``prepend_scheme="first"`` adds a space to the first piece only).
:func:`piece_splitter` checks the flags and then proves it on a probe text; a tokenizer that
fails either is tokenized whole, as before.
"""

from __future__ import annotations

import logging
import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

log = logging.getLogger(__name__)

_PROBE_TEXTS = ("", "a", " a", "\n", "  x\n", "Hello, world!\n", "\n\n  indented  ", "é ü 中文 🙂",
                "def f(x):\n    return x  # ok\n")


def _added_tokens(hf: Any) -> list[Any] | None:
    added = getattr(hf, "added_tokens_decoder", None)
    return list(added.values()) if isinstance(added, dict) else None


def piece_splitter(hf: Any) -> re.Pattern | None:
    """A pattern whose ``split`` cuts text at ``hf``'s added tokens (kept, as the odd items) the
    way the tokenizer does, or None where tokenizing the pieces alone would not give the whole
    text's ids."""
    backend = getattr(hf, "backend_tokenizer", None)
    added = _added_tokens(hf)
    if backend is None or not added:
        return None
    has_normalizer = backend.normalizer is not None
    for t in added:
        if t.lstrip or t.rstrip or t.single_word or (t.normalized and has_normalizer):
            return None
    contents = sorted({t.content for t in added if t.content}, key=len, reverse=True)
    # leftmost, then longest: the tokenizer's own matching of added tokens
    pattern = re.compile("(" + "|".join(map(re.escape, contents)) + ")")
    marks = contents[: min(len(contents), 4)]
    for i, text in enumerate(_PROBE_TEXTS):
        probe = "".join(f"{t}{_PROBE_TEXTS[(i + j) % len(_PROBE_TEXTS)]}"
                        for j, t in enumerate(marks)) + text
        probe = text + probe + text
        whole = backend.encode(probe, add_special_tokens=False).ids
        if whole != _encode_pieces(backend, pattern.split(probe), {}):
            log.info("the tokenizer does not cut its input at added tokens alone: prompts are "
                     "tokenized whole")
            return None
    return pattern


def _encode_pieces(backend: Any, parts: list[str], known: dict[str, Any]) -> list[int]:
    """The ids of a text split into ``parts`` (added tokens at the odd places), the pieces not in
    ``known`` tokenized together and added to it."""
    texts = [p for p in parts[0::2] if p and p not in known]
    if texts:
        for p, enc in zip(texts, backend.encode_batch(texts, add_special_tokens=False)):
            known[p] = array("I", enc.ids)
    out: list[int] = []
    for i, p in enumerate(parts):
        if i % 2:
            out.append(backend.token_to_id(p))
        elif p:
            out.extend(known[p])
    return out


class PieceEncoder:
    """``encode(text)``: the tokenizer's ids for ``text``, from remembered pieces where it can.

    Pieces are kept, most recently used last, up to ``budget_chars`` characters in all (their ids
    as 4-byte integers beside them). Safe to call from several threads.
    """

    def __init__(self, hf: Any, budget_chars: int = 4_000_000):
        self.pattern = piece_splitter(hf)
        self.backend = getattr(hf, "backend_tokenizer", None)
        self.budget = budget_chars
        self.pieces: OrderedDict[str, array] = OrderedDict()
        self.chars = 0
        self.hits = self.misses = 0  # pieces found / tokenized
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.pattern is not None

    def encode(self, text: str) -> list[int] | None:
        """The ids of ``text``; None where this tokenizer must tokenize it whole."""
        if self.pattern is None:
            return None
        parts = self.pattern.split(text)
        with self._lock:
            found = {}
            for p in parts[0::2]:
                ids = self.pieces.get(p)
                if ids is not None:
                    self.pieces.move_to_end(p)
                    found[p] = ids
            before = len(found)
            out = _encode_pieces(self.backend, parts, found)
            new = {p: ids for p, ids in found.items() if p not in self.pieces}
            self.hits += before
            self.misses += len(new)
            for p, ids in new.items():
                if len(p) <= self.budget:
                    self.pieces[p] = ids
                    self.chars += len(p)
            while self.chars > self.budget:
                p, _ = self.pieces.popitem(last=False)
                self.chars -= len(p)
            return out
