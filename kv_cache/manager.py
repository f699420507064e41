"""Reuse for one model: message-keyed entries over the pool's pages, verified by tokens, with
an optional disk tier.

An entry is what a finished turn leaves behind: the token ids of prompt + answer and the pages
that hold their keys and values (the entry holds them). A new request names its messages' keys,
newest first; the manager takes the candidate whose stored tokens share the longest prefix with
the new prompt (a key only finds a candidate: the tokens decide how much of it is valid), and
compares that with what the pool's prefix index finds by tokens alone. Keys not in memory are
looked up in the disk store; pages already in memory are never read from disk again.

When the pool runs short of pages, the least recently used entries drop their holds; their sealed
pages stay cached (and findable by tokens) until the pool's own eviction takes them.

For a model with recurrent state, the state at a prompt's message boundaries is kept as entries
too (state points, ``state_points.py``), so a history changed inside resumes from the boundary
before the change. Restoring from disk is ``restore.py``; writing to disk, ``disk_writer.py``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from kv_cache.model import state_points as points
from kv_cache.model.views import PrefixViews
from kv_cache.saving import DiskSaving, DiskWriter
from kv_cache.errors import OutOfBlocksError
from kv_cache.pages.holders import ENTRY, RESIDENT, SEQUENCE
from kv_cache.room import Room
from kv_cache.pages.pool import PagePool
from kv_cache.queries import Queries
from kv_cache.restore import Restore
from kv_cache.tiers.base import FoundPrefix, StoredEntry, Tier
from kv_cache.entries import Entry, Match
from kv_cache.model.sequence import PagedSequence, Snapshot
from kv_cache.model.state_points import PointEntries
from kv_cache.tokens import common_prefix

log = logging.getLogger("kv_cache.manager")


@dataclass(slots=True)
class ManagerStats:
    hits: int = 0
    misses: int = 0
    tokens_served: int = 0
    disk_hits: int = 0
    tokens_from_disk: int = 0
    pages_read_from_disk: int = 0
    entries_dropped: int = 0
    disk_saves: int = 0
    disk_save_failures: int = 0


class CacheManager(Restore, DiskSaving, PointEntries, Queries, Room):
    """Message-keyed reuse over one ``PagePool`` (one model), optionally backed by a disk store."""

    def __init__(self, pool: PagePool, store: Tier | None = None, max_resident: int = 8,
                 views: PrefixViews | None = None, max_points: int = 2 * points.K):
        """``max_resident``: finished sequences kept with their working buffers (least recently
        used dropped first), so that a turn continuing one of them skips gathering its pages.
        ``views``: the sequences this manager starts read shared prefixes through them (a model
        whose attention ``kv_cache.model.attention`` routes). ``max_points``: state points
        (``kv_cache.model.state_points``) kept in memory, least recently used dropped first (they
        stay on disk)."""
        self.pool = pool
        self.views = views
        self.max_resident = max_resident
        self.max_points = max_points
        self.store = store
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._pending: list[tuple] = []  # entries to write to disk, handed over by flush()
        self._writer = DiskWriter() if store is not None else None
        self._resident: OrderedDict[int, PagedSequence] = OrderedDict()  # oldest first
        self.stats = ManagerStats()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def keys(self) -> list[str]:
        return list(self._entries)

    # -- lookup ---------------------------------------------------------------------------------

    def find(self, prompt: Sequence[int], keys: Iterable[str],
             boundaries: Sequence[int] = ()) -> Match:
        """The longest verified reuse for ``prompt``; always leaves one token to run.

        ``keys`` come newest first; the scan stops at the first whose stored tokens are all a
        prefix of the prompt. Keys the store does not hold cost a lookup in its in-memory index.
        A candidate's stored tokens decide how much of it is valid (the common prefix); a
        sliding window must still have the pages it reads at that point, and a recurrent state
        exists only where an entry ends, so for such models a candidate counts only in full.
        For such models, the state points at the prompt's message ``boundaries`` are candidates
        too (``kv_cache.model.state_points``). When no key verifies in full, the disk's files are
        looked up by the prompt's content too (``_by_content``)."""
        limit = len(prompt) - 1
        best = Match(0, self._no_tables(), "none")
        verified = False
        for key in keys:
            m, stored_len = self._candidate(prompt, limit, key)
            if m is not None and m.tokens > best.tokens:
                best = m
            if m is not None and m.tokens and m.tokens == min(stored_len, limit):
                verified = True
                break  # the newest key that verifies in full: older ones cannot do better
        if not self.pool.spec.has_state:
            n, tables = self._by_prefix(prompt, limit)
            if n > best.tokens:
                best = Match(n, tables, "prefix")
        else:
            best = self._by_points(prompt, limit, boundaries, best)
        if not verified and self.store is not None and best.tokens < limit:
            best = self._by_content(prompt, limit, best)
        best.tokens = self._whole(best.tokens)
        if best.stored is None and best.found is None:
            best.tables = self._cut(best.tables, best.tokens)
        return best

    def _candidate(self, prompt, limit, key: str) -> tuple[Match | None, int]:
        """``key``'s reuse for ``prompt`` (its entry in memory, else in the store's index: no
        file read) and its length; (None, 0) where neither holds it."""
        entry = self._entries.get(key)
        if entry is not None:
            n = self._usable(prompt, limit, entry.tokens, entry.tables, entry.state is not None)
            return Match(n, entry.tables, f"entry:{key}", state=entry.state), len(entry.tokens)
        stored = self.store.get(key) if self.store is not None else None
        if stored is None:
            return None, 0
        n = self._usable(prompt, limit, stored.tokens, self._stored_tables(stored),
                         stored.has_state)
        return Match(n, [], f"disk:{key}", stored), len(stored.tokens)

    def _by_content(self, prompt, limit, best: Match) -> Match:
        """``best``, or what the disk's files hold of ``prompt`` found by its content where
        that is more (``kv_cache.tiers.disk.lookup``; no file read): its longest stored prefix, or,
        for a model with recurrent state, the longest entry it contains whole."""
        if not self.pool.spec.has_state:
            found = self.store.find_prefix(prompt, limit)
            if found is not None and found.tokens > best.tokens:
                return Match(found.tokens, [], "disk-prefix", found=found)
            return best
        key = self.store.find_end(prompt, limit)
        m = None if key is None else self._candidate(prompt, limit, key)[0]
        return m if m is not None and m.tokens > best.tokens else best

    def _whole(self, n: int) -> int:
        """``n`` cut to a page boundary where a reuse must start at one
        (``CacheSpec.whole_pages``: keys per channel over a page)."""
        return n - n % self.pool.page_size if self.pool.spec.whole_pages else n

    def _no_tables(self) -> list[list[int | None]]:
        return [[] for _ in self.pool.groups]

    def _stored_tables(self, stored: StoredEntry) -> list[list]:
        """Which pages ``stored`` has, per group, as a table of placeholders (None: not stored)."""
        tail = [True] if stored.tail_tokens else []
        return [[None] * skip + [True] * count + tail for skip, count in stored.layout]

    def _usable(self, prompt, limit, tokens, tables, has_state: bool) -> int:
        n = min(common_prefix(tokens, prompt), limit)
        if any(not s.kind.usable(n, len(tokens), has_state) for s in self.pool.spec.states):
            return 0
        return n if self._window_ok(tables, n) else 0

    def _window_ok(self, tables, n: int) -> bool:
        """Whether every group holds the pages it reads after ``n`` positions (a sliding
        window's may have been released)."""
        P = self.pool.page_size
        return all(g.kind.holds(table, n, P) for g, table in zip(self.pool.groups, tables))

    def _by_prefix(self, prompt, limit) -> tuple[int, list[list[int | None]]]:
        """The longest reuse the pool's prefix index finds by tokens alone."""
        pool, P = self.pool, self.pool.page_size
        full = [g for g, spec in enumerate(pool.groups) if spec.kind.reads_all]
        found = {g: pool.match_prefix(prompt, g) for g in full}
        pages = min((len(b) for b in found.values()), default=len(prompt) // P)
        n = min(pages * P, limit)
        tables = []
        for g, spec in enumerate(pool.groups):
            if g in found:
                tables.append(found[g][:pages])
            else:
                hashes = pool.chain(prompt[: pages * P], g)
                tables.append(pool.match_hashes(hashes, prompt))
        while n > 0 and not self._window_ok(tables, n):
            n -= P  # NOTE: an earlier page boundary may still have its window cached
            n -= n % P
        return max(n, 0), tables

    def _cut(self, tables, n: int) -> list[list[int | None]]:
        """``tables`` cut to the pages that the first ``n`` positions use (and a window reads)."""
        P = self.pool.page_size
        return [g.kind.cut(table, n, P) for g, table in zip(self.pool.groups, tables)]

    def keep(self, seq: PagedSequence) -> None:
        """Keep ``seq`` (finished) resident with its working buffers: a request that continues
        it goes on from it without gathering its pages. The least recently used resident
        sequence beyond ``max_resident`` is closed. A sequence whose new positions do not fit
        in the pool is closed instead (it could not be verified against its pages later)."""
        try:
            self.with_room(seq.commit)
        except OutOfBlocksError:
            seq.close()
            return
        if self.max_resident <= 0:
            seq.close()
            return
        self._resident[id(seq)] = seq
        self.pool.holders.move((b for t in seq.tables for b in t.blocks), SEQUENCE, RESIDENT)
        while len(self._resident) > self.max_resident:
            self._unreside(next(iter(self._resident))).close()

    def resident_tokens(self) -> int:
        return sum(len(s.tokens) for s in self._resident.values())

    def resident_blocks(self) -> list[int]:
        """The pages the resident sequences hold (each is one more holder of its pages)."""
        return [b for s in self._resident.values() for t in s.tables for b in t.blocks
                if b is not None]

    def _take_resident(self, prompt: Sequence[int], match: Match) -> PagedSequence | None:
        """The resident sequence ``prompt`` goes on from, trimmed to what the tokens verify;
        None where the pages hold as much, or where each would lose more than half its tokens
        (NOTE)."""
        best, best_n = None, 0
        for seq in self._resident.values():
            n = min(common_prefix(seq.tokens, prompt), len(prompt) - 1)
            if not seq.can_trim_to(n):
                # NOTE: keys per channel: a resident sequence holds the floats of its open page
                # and of the last page it sealed (so it goes on mid-page, unlike a reuse from
                # pages); further back only from a page boundary.
                n = self._whole(n)
            # NOTE: a sequence trimmed by more than half is another conversation that shares
            # only a beginning (agents' system prompt): taking it would save one copy of that
            # beginning from the pages and cost its own conversation the copy of all of its
            # history at its next turn
            if n > best_n and 2 * n >= len(seq.tokens) and seq.has_buffers() \
                    and seq.can_trim_to(n):
                best, best_n = seq, n
        if best is None or best_n < match.tokens:
            return None
        self._unreside(id(best))
        best.trim(len(best.tokens) - best_n)  # NOTE: verified by tokens, like any other reuse
        return best

    def _close_resident(self) -> None:
        while self._resident:
            self._unreside(next(reversed(self._resident))).close()

    def start(
        self, prompt: Sequence[int], keys: Iterable[str] = (), use_cache: bool = True,
        boundaries: Sequence[int] = ()
    ) -> tuple[PagedSequence, Match]:
        """A sequence that holds the reusable prefix of ``prompt``; the caller runs the rest.
        ``boundaries``: the prompt's message boundaries (``state_points.boundaries``); a model
        with recurrent state resumes from the last one it holds a state at, and the sequence
        snapshots its state at those after the reuse (``seq.points``: the caller stops its
        prompt pieces there), saved with the next ``save`` of it."""
        if not use_cache:
            return self.new_sequence(), Match(0, self._no_tables(), "none")
        match = self.find(prompt, keys, boundaries)
        resident = self._take_resident(prompt, match)
        if resident is not None:
            self.stats.hits += 1
            self.stats.tokens_served += len(resident.tokens)
            self._plan_points(resident, boundaries, len(prompt))
            return resident, Match(len(resident.tokens), [list(t.blocks) for t in resident.tables],
                                   "resident")
        loaded: list[list[int | None]] = []
        if match.stored is not None or match.found is not None:
            match.tokens, loaded, match.state = self._load(match.stored, match.tokens) \
                if match.stored is not None else self._load_found(match.found, prompt)
            match.tables = loaded
            if match.tokens == 0:
                match.source = "none"
        elif match.source.startswith("entry:"):
            self._entries.move_to_end(match.source[6:])
        if match.tokens:
            self.stats.hits += 1
            self.stats.tokens_served += match.tokens
            if match.stored is not None or match.found is not None:
                self.stats.disk_hits += 1
                self.stats.tokens_from_disk += match.tokens
            if match.stored is not None:
                self.store.touch(match.stored.key)
        else:
            self.stats.misses += 1
        seq = PagedSequence(self.pool, prompt[: match.tokens],
                            match.tables if match.tokens else [], match.state, self.views)
        for t in loaded:  # the sequence holds them now
            self.pool.release_all(t)
        self._plan_points(seq, boundaries, len(prompt))
        return seq, match

    def new_sequence(self) -> PagedSequence:
        """An empty sequence (no reuse)."""
        return PagedSequence(self.pool, views=self.views)

    # -- entries --------------------------------------------------------------------------------

    def save(self, key: str, seq: PagedSequence, n_tokens: int | None = None) -> Entry:
        """Keep the first ``n_tokens`` (default all) of ``seq`` under ``key``, with the recurrent
        state when that is where the sequence stands; the disk copy is written by the next
        ``flush()``."""
        self.with_room(seq.commit)
        n = len(seq.tokens) if n_tokens is None else n_tokens
        self._save_points(seq, n)
        state = seq.state_snapshot() if n == len(seq.tokens) else None
        return self._keep(key, seq, n, state, to_disk=n > 0)

    def _keep(self, key: str, seq: PagedSequence, n: int, state: Snapshot | None,
              to_disk: bool) -> Entry:
        """``seq``'s first ``n`` tokens (committed) as the entry ``key``, holding their pages."""
        tables = seq.prefix_tables(n)
        for t in tables:
            self.pool.hold_all(t, ENTRY)
        self.drop(key, from_disk=False)
        self._entries[key] = entry = Entry(key, tuple(seq.tokens[:n]), tables, state)
        if self.store is not None and to_disk:
            self._pending.append(self._capture(entry))
        return entry

    def flush(self) -> None:
        """Hand pending entries to the disk writer (call once the answer is out)."""
        pending, self._pending = self._pending, []
        for captured in pending:
            self._writer.submit(self._writer_task(captured))

    def sync(self) -> None:
        """Wait for every write handed to the disk writer (for a consistent view of the disk)."""
        self.flush()
        if self._writer is not None:
            self._writer.drain()

    def close(self) -> None:
        """Close the resident sequences, finish the disk writes and close the store."""
        self._close_resident()
        self.sync()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self.store.close()

    def drop(self, key: str, from_disk: bool = True) -> bool:
        """Forget ``key`` in memory (and on disk unless told otherwise)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            for t in entry.tables:
                self.pool.release_all(t, ENTRY)
        if from_disk and self.store is not None:
            self.sync()  # a queued write of this key must not bring it back
        on_disk = bool(from_disk and self.store is not None and self.store.delete(key))
        return entry is not None or on_disk

    def clear(self) -> None:
        for key in list(self._entries):
            self.drop(key, from_disk=False)
