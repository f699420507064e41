"""Drafts for speculative decoding, from token ids the server already has: :class:`Drafter`.

An agent's answer is mostly text already in its conversation (an edit's ``old_string``, a file
rewritten with one change, context lines of a patch), so the tokens that followed the latest
earlier occurrence of the answer's last few tokens are a good guess of what comes next (prompt
lookup). Sources:

- a client's prediction (OpenAI's Predicted Outputs): where the answer is in it
  (``prediction.py``: from its start, found again where the answer left it);
- the sequence's own prompt and answer so far;
- the token ids of other entries the cache saved (:class:`SharedIndex`: a file another session
  read, an answer being regenerated), matched on longer n-grams.

No source comes first: while the answer follows the source of its last draft, that one goes on;
where it leaves it, each source that has a continuation offers it, and the one that agrees with
the most of the answer's last tokens (``_agreement``) drafts. A prediction's start is where the
answer starts, which counts as some agreement (``ANCHOR``), so a client's prediction drafts the
start of an answer unless another source agrees with more of what came before (the saved
sequence of the same request, regenerated: its exact token ids, where the prediction's text may
tokenize otherwise).

Each source is an :class:`NgramIndex` (n-gram -> where its latest occurrence ended), kept up to
date as tokens arrive, so a step costs a few dictionary lookups, never a scan of the history.
The draft length adapts per sequence: it grows while drafts are taken whole, shrinks to what was
taken, and after drafts that keep failing the sequence stops drafting for a while (longer each
time), so free text pays nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

from .prediction import Prediction

_BITS = 20  # token ids below 2**20 pack three to an int64 key (the length above them)
_MASK = (1 << _BITS) - 1
AGREE = 32  # the most answer tokens a source's agreement counts (``Drafter._agreement``)
ANCHOR = 8  # the agreement a prediction's start has at the answer's start


def _keys(arr: np.ndarray, n: int, lo: int, hi: int) -> np.ndarray:
    """Keys of the n-grams ending (exclusive) at positions ``lo..hi-1`` of ``arr`` (int64)."""
    k = np.zeros(hi - lo, np.int64)
    for j in range(n):
        k = (k << _BITS) | (arr[lo - n + j: hi - n + j] & _MASK)
    return k | (n << 3 * _BITS)


class NgramIndex:
    """n-grams (of each length in ``ns``) of one growing token list -> the position right after
    their latest occurrence. ``extend(tokens, upto)`` indexes the n-grams that end at or before
    ``upto``; ``lookup`` finds the latest earlier occurrence of a suffix."""

    def __init__(self, ns: Sequence[int] = (3, 2)) -> None:
        assert all(1 <= n <= 3 for n in ns), ns
        self.ns = tuple(sorted(ns, reverse=True))
        self.map: dict[int, int] = {}
        self.upto = 0  # n-grams ending at positions <= upto are in the map

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        if upto <= self.upto:
            return
        lo = self.upto + 1
        if upto - lo < 8:  # a step's few tokens: no array
            for e in range(lo, upto + 1):
                for n in self.ns:
                    if e >= n:
                        self.map[_key(tokens[e - n:e])] = e
        else:
            arr = np.asarray(tokens[max(0, lo - max(self.ns)):upto], np.int64)
            off = max(0, lo - max(self.ns))
            for n in reversed(self.ns):  # NOTE: later positions overwrite earlier: the latest
                start = max(lo, n)
                if start <= upto:
                    keys = _keys(arr, n, start - off, upto + 1 - off)
                    self.map.update(zip(keys.tolist(), range(start, upto + 1)))
        self.upto = upto

    def lookup(self, tokens: Sequence[int], end: int,
               own: bool = True) -> tuple[int, int] | None:
        """(position after the latest occurrence of the n-gram of ``tokens`` that ends at
        ``end``, n) for the longest n that occurs; None when none does. ``own``: the index is
        over ``tokens`` itself, so only occurrences before ``end`` count."""
        for n in self.ns:
            if end >= n:
                pos = self.map.get(_key(tokens[end - n:end]))
                if pos is not None and (pos < end or not own):
                    return pos, n
        return None


def _key(gram: Sequence[int]) -> int:
    k = 0
    for t in gram:
        k = (k << _BITS) | (int(t) & _MASK)
    return k | (len(gram) << 3 * _BITS)


class SharedIndex:
    """Token ids of entries the cache saved (other conversations, earlier answers), indexed by
    their 3-grams; bounded to ``max_tokens`` (the oldest sources go first).

    NOTE: ~170 bytes a token in Python objects (the token list, the dict's key and value): the
    default bound keeps it near 11 MB. At 262,144 tokens it held 43 MB, which a server's
    resident memory showed as growth over its first ~700 requests (an earlier run of
    benchmarks/memory_growth.py, in docs/BENCHMARKS.md's git history); recent entries are the
    ones worth drafting from."""

    def __init__(self, max_tokens: int = 65_536) -> None:
        self.max_tokens = max_tokens
        self.sources: OrderedDict[int, list[int]] = OrderedDict()
        self.map: dict[int, int] = {}  # key -> source id << 32 | position after
        self.tokens = 0
        self._next = 0

    def add(self, tokens: Sequence[int]) -> None:
        """Index a saved sequence's token ids (a long one keeps its last ``max_tokens``)."""
        toks = list(tokens[-self.max_tokens:])
        if len(toks) < 8:
            return
        sid, self._next = self._next, self._next + 1
        self.sources[sid] = toks
        self.tokens += len(toks)
        keys = _keys(np.asarray(toks, np.int64), 3, 3, len(toks) + 1)
        self.map.update(zip(keys.tolist(), range((sid << 32) + 3, (sid << 32) + len(toks) + 1)))
        while self.tokens > self.max_tokens and len(self.sources) > 1:
            old, dropped = self.sources.popitem(last=False)
            self.tokens -= len(dropped)
            for k in _keys(np.asarray(dropped, np.int64), 3, 3, len(dropped) + 1).tolist():
                if self.map.get(k, -1) >> 32 == old:
                    del self.map[k]

    def draft(self, tokens: Sequence[int], end: int, k: int) -> list[int]:
        found = self.find(tokens, end)
        return found[0][found[1]:found[1] + k] if found is not None else []

    def find(self, tokens: Sequence[int], end: int) -> tuple[list[int], int] | None:
        """(a saved source, the position after where ``tokens[:end]``'s last four tokens occur
        in it), or None."""
        if end < 4:
            return None
        hit = self.map.get(_key(tokens[end - 3:end]))
        if hit is None:
            return None
        sid, at = hit >> 32, hit & 0xFFFFFFFF
        src = self.sources.get(sid)
        if src is None or at < 4 or src[at - 4] != tokens[end - 4]:  # a 4th must agree
            return None
        return src, at


class Drafter:
    """The draft source and the adaptive draft length of one choice. ``context`` is the
    choice's prompt and answer so far (the list the choice appends to)."""

    def __init__(self, context: list[int], max_len: int, prediction: Sequence[int] = (),
                 shared: SharedIndex | None = None, start: int | None = None) -> None:
        self.context, self.max_len, self.shared = context, max_len, shared
        self.start = len(context) if start is None else start  # where the answer begins
        self.own = NgramIndex()
        self.prediction = Prediction(prediction) if prediction else None
        self.length = min(4, max_len)
        self.hits, self.fails = 1.0, 1.0  # draft tokens taken / drafts cut short (decaying)
        self.misses = 0  # drafts in a row of which nothing was taken
        self.pause = 0  # steps left without drafting
        self.backoff = 4
        self.source = ""  # where the last draft came from
        self.seen = self.start  # the context's tokens taken in by _follow
        self.copy: tuple[list[int], int, str] | None = None  # (source tokens, position, name)

    def propose(self, room: int) -> list[int]:
        """A draft of at most ``room`` tokens to follow the context (may be empty)."""
        k = min(self.length, room, self.max_len)
        self._follow()
        if k <= 0:
            return []
        if self.pause > 0:
            self.pause -= 1
            return []
        if self.copy is not None:  # the answer is copying a source: go on with it
            src, pos, source = self.copy
            d = self._slice(src, pos, k)
            if d:
                self.source = source
                return d
        best, draft = -1, []
        for source, src, pos in self._found():
            d = self._slice(src, pos, k)
            score = self._agreement(src, pos, source) if d else -1
            if score > best:  # NOTE: a tie keeps the earlier source, in ``_found``'s order
                best, draft, self.copy, self.source = score, d, (src, pos, source), source
        return draft

    def _agreement(self, src: list[int], pos: int, source: str) -> int:
        """How many of the answer's last tokens (up to ``AGREE``) equal those before ``pos`` in
        ``src``: the longer, the likelier its continuation is the answer's. A prediction that
        agrees back to its start, where the answer starts, gets ``ANCHOR`` more (the client
        said the answer starts there)."""
        ctx, end, n = self.context, len(self.context), 0
        while n < AGREE and n < pos and src[pos - n - 1] == ctx[end - n - 1]:
            n += 1
        if source == "prediction" and n == pos and end - n == self.start:
            n += ANCHOR
        return n

    def _slice(self, src: list[int], pos: int, k: int) -> list[int]:
        """``k`` tokens of ``src`` from ``pos``. In the answer's own context a copy that
        reaches its end overlaps itself (LZ77's overlapping copy): the answer is repeating the
        last ``end - pos`` tokens, so the draft repeats them too (a run of one digit, a rule
        line of dashes, a phrase a small model loops on), where the plain slice would stop at
        the end: a draft no longer than the period."""
        if src is not self.context:
            return src[pos:pos + k]
        period = len(src) - pos
        if period <= 0 or period >= k:
            return src[pos:pos + k]
        return [src[pos + i % period] for i in range(k)]

    def _follow(self) -> None:
        """Take in the tokens the answer got since the last draft: a copy it was following
        goes on where they match it (they are compared, never the whole answer), and the
        prediction follows the answer (``prediction.py``)."""
        ctx, end = self.context, len(self.context)
        new = ctx[self.seen:end]
        self.seen = end
        if self.prediction is not None:
            for t in new:
                self.prediction.add(t)
        if self.copy is not None and new:
            src, pos, source = self.copy
            if src[pos:pos + len(new)] == new:
                self.copy = (src, pos + len(new), source)
            else:
                self.copy = None

    def _found(self):
        """Where the answer may go on from (each a (source name, token list, position after)):
        the prediction, where the answer is in step with it; where the answer's last tokens
        occurred before in its own context; in other saved entries."""
        ctx, end = self.context, len(self.context)
        p = self.prediction
        if p is not None and p.in_step:
            yield "prediction", p.tokens, p.pos
        self.own.extend(ctx, end - 1)
        hit = self.own.lookup(ctx, end)
        if hit is not None:
            yield "context", ctx, hit[0]
        if self.shared is not None:
            found = self.shared.find(ctx, end)
            if found is not None:
                yield "cache", found[0], found[1]

    @property
    def rate(self) -> float:
        """The chance that one more draft token is taken (from the recent drafts)."""
        return self.hits / (self.hits + self.fails)

    def expected(self, n: int) -> float:
        """Tokens a step that verifies ``n`` draft tokens is expected to give (1 without)."""
        r = min(self.rate, 0.999)
        return (1 - r ** (n + 1)) / (1 - r)

    def taken(self, proposed: int, accepted: int) -> None:
        """How the last draft went: its length and how many of its tokens were taken."""
        if proposed == 0:
            return
        self.hits = self.hits * 0.8 + accepted
        self.fails = self.fails * 0.8 + (accepted < proposed)
        if accepted == proposed:
            self.length = min(self.max_len, self.length * 2)
        elif accepted:
            self.length = max(2, accepted + 1)
        else:
            self.length = max(1, self.length // 2)
        if accepted:
            self.misses, self.backoff = 0, 4
            return
        self.misses += 1
        if self.misses >= 3:  # drafts keep failing: free text; stop for a while
            self.pause, self.misses = self.backoff, 0
            self.backoff = min(self.backoff * 2, 256)
