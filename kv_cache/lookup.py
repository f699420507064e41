"""Finding a prompt's reuse: which stored tokens it can go on from, and where they are.

A new request names its messages' keys, newest first; the candidate whose stored tokens share
the longest prefix with the new prompt wins (a key only finds a candidate: the tokens decide how
much of it is valid), compared with what the pool's prefix index finds by tokens alone. Keys not
in memory are looked up in the store's in-memory index (no file read); where no key verifies in
full, the store's files are looked up by the prompt's content. For a model with recurrent state,
the state points at the prompt's message boundaries are candidates too
(``kv_cache.model.state_points``). A prompt's image spans go with its tokens to every one of
these (``kv_cache.pages.spans``): a candidate holds only where its spans agree, and a reuse never
ends inside an image. The answer is a ``Match``: it names what to reuse; loading
what it names from disk is ``restore.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from kv_cache.entries import Entries
from kv_cache.model.sequence import Snapshot
from kv_cache.model.state_points import point_keys
from kv_cache.pages.pool import PagePool
from kv_cache.pages.spans import Span, agree, as_spans, outside
from kv_cache.tiers.base import FoundPrefix, StoredEntry, Tier
from kv_cache.tokens import common_prefix


@dataclass(slots=True)
class Match:
    """What a new prompt reuses, and where it was found."""

    tokens: int  # prompt tokens whose keys and values are reused
    tables: list[list[int | None]]
    source: str  # "entry:<key>", "disk:<key>", "prefix", "disk-prefix", "resident" or "none"
    stored: StoredEntry | None = None
    state: Snapshot | None = None
    found: FoundPrefix | None = None  # a prefix the disk's files hold, found by its content

    @property
    def blocks(self) -> list[int | None]:
        return self.tables[0] if self.tables else []


def whole(pool: PagePool, n: int) -> int:
    """``n`` cut to a page boundary where a reuse must start at one (``CacheSpec.whole_pages``:
    keys per channel over a page)."""
    return n - n % pool.page_size if pool.spec.whole_pages else n


def edge(pool: PagePool, n: int, spans: Sequence[Span]) -> int:
    """``n`` cut where a reuse may end: at a page boundary where it must (``whole``), and
    never inside an image span (``outside``)."""
    while (m := outside(whole(pool, n), spans)) != n:
        n = m
    return n


def cut(pool: PagePool, tables, n: int) -> list[list[int | None]]:
    """``tables`` cut to the pages that the first ``n`` positions use (and a window reads)."""
    P = pool.page_size
    return [g.kind.cut(table, n, P) for g, table in zip(pool.groups, tables)]


def no_tables(pool: PagePool) -> list[list[int | None]]:
    """One empty table per group of ``pool``."""
    return [[] for _ in pool.groups]


class Lookup:
    """The longest verified reuse of a prompt among ``entries`` (in memory), the ``store``'s
    index and files, and ``pool``'s prefix index. It reads them and changes nothing."""

    def __init__(self, pool: PagePool, entries: Entries, store: Tier | None):
        self.pool, self.entries, self.store = pool, entries, store

    def find(self, prompt: Sequence[int], keys: Iterable[str],
             boundaries: Sequence[int] = (), spans: Sequence[Span] = ()) -> Match:
        """The longest verified reuse for ``prompt``; always leaves one token to run.

        ``keys`` come newest first; the scan stops at the first whose stored tokens are all a
        prefix of the prompt. Keys the store does not hold cost a lookup in its in-memory index.
        A candidate's stored tokens decide how much of it is valid (the common prefix); a
        sliding window must still have the pages it reads at that point, and a recurrent state
        exists only where an entry ends, so for such models a candidate counts only in full.
        For such models, the state points at the prompt's message ``boundaries`` are candidates
        too (``kv_cache.model.state_points``). When no key verifies in full, the disk's files are
        looked up by the prompt's content too (``_by_content``). With image ``spans``
        (``kv_cache.pages.spans``), a candidate holds only as far as its spans agree with the
        prompt's, and a reuse never ends inside an image: it is cut back to the image's start."""
        limit, spans = len(prompt) - 1, as_spans(spans)
        best = Match(0, no_tables(self.pool), "none")
        verified = False
        for key in keys:
            m, stored_len = self._candidate(prompt, limit, key, spans)
            if m is not None and m.tokens > best.tokens:
                best = m
            if m is not None and m.tokens and m.tokens == min(stored_len, limit):
                verified = True
                break  # the newest key that verifies in full: older ones cannot do better
        if not self.pool.spec.has_state:
            n, tables = self._by_prefix(prompt, limit, spans)
            if n > best.tokens:
                best = Match(n, tables, "prefix")
        else:
            best = self._by_points(prompt, limit, boundaries, best, spans)
        if not verified and self.store is not None and best.tokens < limit:
            best = self._by_content(prompt, limit, best, spans)
        best.tokens = edge(self.pool, best.tokens, spans)
        if best.stored is None and best.found is None:
            best.tables = cut(self.pool, best.tables, best.tokens)
        return best

    def _candidate(self, prompt, limit, key: str, spans) -> tuple[Match | None, int]:
        """``key``'s reuse for ``prompt`` with ``spans`` (its entry in memory, else in the
        store's index: no file read) and its length; (None, 0) where neither holds it."""
        entry = self.entries.get(key)
        if entry is not None:
            n = self._usable(prompt, limit, entry.tokens, entry.tables, entry.state is not None,
                             (entry.spans, spans))
            return Match(n, entry.tables, f"entry:{key}", state=entry.state), len(entry.tokens)
        stored = self.store.get(key) if self.store is not None else None
        if stored is None:
            return None, 0
        n = self._usable(prompt, limit, stored.tokens, _stored_tables(stored), stored.has_state,
                         (stored.spans, spans))
        return Match(n, [], f"disk:{key}", stored), len(stored.tokens)

    def _by_points(self, prompt: Sequence[int], limit: int, boundaries: Sequence[int],
                   best: Match, spans) -> Match:
        """``best``, or the longest state point at one of ``boundaries`` (in memory, else in
        the store's index) where that is more; each is verified by its tokens like any entry."""
        at = [b for b in boundaries if best.tokens < b <= limit]
        for b, key in reversed(list(zip(at, point_keys(prompt, at)))):
            m = self._candidate(prompt, limit, key, spans)[0]
            if m is not None and m.tokens == b:
                return m
        return best

    def _by_content(self, prompt, limit, best: Match, spans) -> Match:
        """``best``, or what the disk's files hold of ``prompt`` found by its content where
        that is more (``kv_cache.tiers.disk.lookup``; no file read): its longest stored prefix, or,
        for a model with recurrent state, the longest entry it contains whole."""
        if not self.pool.spec.has_state:
            found = self.store.find_prefix(prompt, limit, spans)
            if found is not None and found.tokens > best.tokens:
                return Match(found.tokens, [], "disk-prefix", found=found)
            return best
        key = self.store.find_end(prompt, limit, spans)
        m = None if key is None else self._candidate(prompt, limit, key, spans)[0]
        return m if m is not None and m.tokens > best.tokens else best

    def _usable(self, prompt, limit, tokens, tables, has_state: bool, spans) -> int:
        """How much of a candidate's ``tokens`` holds for ``prompt``: the common prefix, as
        far as ``spans`` (the candidate's, the prompt's) agree (``kv_cache.pages.spans``)."""
        n = agree(min(common_prefix(tokens, prompt), limit), *spans)
        if any(not s.kind.usable(n, len(tokens), has_state) for s in self.pool.spec.states):
            return 0
        return n if self._window_ok(tables, n) else 0

    def _window_ok(self, tables, n: int) -> bool:
        """Whether every group holds the pages it reads after ``n`` positions (a sliding
        window's may have been released)."""
        P = self.pool.page_size
        return all(g.kind.holds(table, n, P) for g, table in zip(self.pool.groups, tables))

    def _by_prefix(self, prompt, limit, spans) -> tuple[int, list[list[int | None]]]:
        """The longest reuse the pool's prefix index finds by tokens (and image ``spans``: the
        page hashes carry them) alone."""
        pool, P = self.pool, self.pool.page_size
        full = [g for g, spec in enumerate(pool.groups) if spec.kind.reads_all]
        found = {g: pool.match_prefix(prompt, g, spans) for g in full}
        pages = min((len(b) for b in found.values()), default=len(prompt) // P)
        n = outside(min(pages * P, limit), spans)
        tables = []
        for g, spec in enumerate(pool.groups):
            if g in found:
                tables.append(found[g][:pages])
            else:
                hashes = pool.chain(prompt[: pages * P], g, spans)
                tables.append(pool.match_hashes(hashes, prompt))
        while n > 0 and not self._window_ok(tables, n):
            n -= P  # NOTE: an earlier page boundary may still have its window cached
            n = outside(n - n % P, spans)
        return max(n, 0), tables


def _stored_tables(stored: StoredEntry) -> list[list]:
    """Which pages ``stored`` has, per group, as a table of placeholders (None: not stored)."""
    tail = [True] if stored.tail_tokens else []
    return [[None] * skip + [True] * count + tail for skip, count in stored.layout]
