"""Reuse for one model: message-keyed entries over the pool's pages, verified by tokens.

An entry is what a finished turn leaves behind: the token ids of prompt + answer and the pages
that hold their keys and values (the entry holds them). A new request names its messages' keys,
newest first; the manager takes the candidate whose stored tokens share the longest prefix with
the new prompt (a key only finds a candidate: the tokens decide how much of it is valid), and
compares that with what the pool's prefix index finds by tokens alone.

When the pool runs short of pages, the least recently used entries drop their holds; their sealed
pages stay cached (and findable by tokens) until the pool's own eviction takes them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .page_pool import PagePool
from .sequence import PagedSequence


@dataclass(slots=True)
class Entry:
    key: str
    tokens: tuple[int, ...]
    blocks: list[int]


@dataclass(slots=True)
class Match:
    tokens: int  # prompt tokens whose keys and values are reused
    blocks: list[int]
    source: str  # "entry:<key>", "prefix" or "none"


@dataclass(slots=True)
class ManagerStats:
    entries: int = 0
    hits: int = 0
    misses: int = 0
    tokens_served: int = 0
    entries_dropped: int = 0
    extra: dict = field(default_factory=dict)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class CacheManager:
    """Message-keyed reuse over one ``PagePool`` (one model)."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self.stats = ManagerStats()
        pool.reclaimer = self._reclaim

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def keys(self) -> list[str]:
        return list(self._entries)

    # -- lookup ---------------------------------------------------------------------------------

    def find(self, prompt: Sequence[int], keys: Iterable[str]) -> Match:
        """The longest verified reuse for ``prompt``; always leaves one token to run."""
        limit = len(prompt) - 1
        best = Match(0, [], "none")
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            n = min(common_prefix(entry.tokens, prompt), limit)
            if n > best.tokens:
                best = Match(n, entry.blocks, f"entry:{key}")
        by_prefix = self.pool.match_prefix(prompt)
        n = min(len(by_prefix) * self.pool.page_size, limit)
        if n > best.tokens:
            best = Match(n, by_prefix, "prefix")
        best.blocks = best.blocks[: -(-best.tokens // self.pool.page_size)]
        return best

    def start(
        self, prompt: Sequence[int], keys: Iterable[str] = (), use_cache: bool = True
    ) -> tuple[PagedSequence, Match]:
        """A sequence that holds the reusable prefix of ``prompt``; the caller runs the rest."""
        match = self.find(prompt, keys) if use_cache else Match(0, [], "none")
        if match.source.startswith("entry:"):
            self._entries.move_to_end(match.source[6:])
        if use_cache:
            if match.tokens:
                self.stats.hits += 1
                self.stats.tokens_served += match.tokens
            else:
                self.stats.misses += 1
        return PagedSequence(self.pool, prompt[: match.tokens], match.blocks), match

    # -- entries --------------------------------------------------------------------------------

    def save(self, key: str, seq: PagedSequence, n_tokens: int | None = None) -> Entry:
        """Keep the first ``n_tokens`` (default all) of ``seq`` under ``key``."""
        seq.commit()
        n = len(seq.tokens) if n_tokens is None else n_tokens
        blocks = seq.prefix_blocks(n)
        for b in blocks:
            self.pool.hold(b)
        self.drop(key)
        entry = Entry(key, tuple(seq.tokens[:n]), list(blocks))
        self._entries[key] = entry
        self.stats.entries = len(self._entries)
        return entry

    def drop(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        for b in entry.blocks:
            self.pool.release(b)
        self.stats.entries = len(self._entries)
        return True

    def clear(self) -> None:
        for key in list(self._entries):
            self.drop(key)

    def _reclaim(self, n_pages: int) -> None:
        while self._entries and not self.pool.can_allocate(n_pages):
            self.drop(next(iter(self._entries)))
            self.stats.entries_dropped += 1
