"""Resident sequences: finished sequences kept whole, working buffers and all, for a next turn.

A turn that continues a resident sequence goes on from it without gathering its pages from the
pool. At most ``max_resident`` are kept, the least recently kept closed first; each holds its
pages as a ``RESIDENT`` (``kv_cache.pages.holders``), and as a ``SEQUENCE`` again once handed
out. Like any reuse, one is taken only as far as the new prompt's tokens (and image spans)
verify it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from kv_cache.lookup import whole
from kv_cache.model.sequence import PagedSequence
from kv_cache.pages.holders import RESIDENT, SEQUENCE
from kv_cache.pages.pool import PagePool
from kv_cache.pages.spans import Span, agree, as_spans
from kv_cache.tokens import common_prefix


class Residents:
    """The resident sequences over ``pool``, oldest first."""

    def __init__(self, pool: PagePool, max_resident: int):
        self.pool, self.max_resident = pool, max_resident
        self._seqs: OrderedDict[int, PagedSequence] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seqs)

    def keep(self, seq: PagedSequence) -> None:
        """Keep ``seq`` (finished, committed); beyond ``max_resident``, the oldest is closed
        (``seq`` itself where none may be kept)."""
        if self.max_resident <= 0:
            seq.close()
            return
        self._seqs[id(seq)] = seq
        self.pool.holders.move((b for t in seq.tables for b in t.blocks), SEQUENCE, RESIDENT)
        while len(self._seqs) > self.max_resident:
            self.close_oldest()

    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self._seqs.values())

    def blocks(self) -> list[int]:
        """The pages the resident sequences hold (each is one more holder of its pages)."""
        return [b for s in self._seqs.values() for t in s.tables for b in t.blocks
                if b is not None]

    def take(self, prompt: Sequence[int], at_least: int,
             spans: Sequence[Span] = ()) -> PagedSequence | None:
        """The resident sequence ``prompt`` (with image ``spans``) goes on from, trimmed to what
        the tokens and spans verify and no longer resident; None where none holds more than
        ``at_least`` tokens of it (what the pages hold), or where each would lose more than half
        its tokens (NOTE)."""
        best, best_n, spans = None, 0, as_spans(spans)
        for seq in self._seqs.values():
            n = agree(min(common_prefix(seq.tokens, prompt), len(prompt) - 1), seq.spans, spans)
            if not seq.can_trim_to(n):
                # NOTE: keys per channel: a resident sequence holds the floats of its open page
                # and of the last page it sealed (so it goes on mid-page, unlike a reuse from
                # pages); further back only from a page boundary.
                n = agree(whole(self.pool, n), seq.spans, spans)
            # NOTE: a sequence trimmed by more than half is another conversation that shares
            # only a beginning (agents' system prompt): taking it would save one copy of that
            # beginning from the pages and cost its own conversation the copy of all of its
            # history at its next turn
            if n > best_n and 2 * n >= len(seq.tokens) and seq.has_buffers() \
                    and seq.can_trim_to(n):
                best, best_n = seq, n
        if best is None or best_n < at_least:
            return None
        self._release(id(best))
        best.trim(len(best.tokens) - best_n)  # NOTE: verified by tokens, like any other reuse
        best.spans = spans  # the same as its own up to best_n; the new prompt's after
        return best

    def close_oldest(self) -> None:
        """Close the least recently kept sequence (there must be one)."""
        self._release(next(iter(self._seqs))).close()

    def close_all(self, newest_first: bool = False) -> None:
        while self._seqs:
            key = next(reversed(self._seqs)) if newest_first else next(iter(self._seqs))
            self._release(key).close()

    def _release(self, key: int) -> PagedSequence:
        """Resident sequence ``key``, no longer resident: its holds are a sequence's again."""
        seq = self._seqs.pop(key)
        self.pool.holders.move((b for t in seq.tables for b in t.blocks), RESIDENT, SEQUENCE)
        return seq
