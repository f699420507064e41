"""Reuse for one model: message-keyed entries over the pool's pages, verified by tokens, with
an optional disk tier.

An entry is what a finished turn leaves behind: the token ids of prompt + answer and the pages
that hold their keys and values (the entry holds them). A new request names its messages' keys;
the manager finds the longest verified reuse of its prompt (``lookup.py``), loads what was found
on disk (``restore.py``) or goes on from a resident sequence (``residents.py``), and starts a
sequence that holds it. Saving a sequence keeps it as an entry (``entries.py``) and hands its
disk copy to a background writer (``saving.py``). When the pool runs short of pages, the least
recently used holders kept for reuse are dropped (``room.py``); their sealed pages stay cached
(and findable by tokens) until the pool's own eviction takes them. Beside entries, it keeps
named arrays by a key of the user's (``arrays.py``: in memory and on disk, in its budgets).

For a model with recurrent state, the state at a prompt's message boundaries is kept as entries
too (state points, ``kv_cache.model.state_points``), so a history changed inside resumes from the
boundary before the change.

The manager holds these parts and answers for them: its methods are the whole of what a user
(the server) asks of the cache, in plain values.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict
from typing import Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import mlx.core as mx

from kv_cache.arrays import KeptArrays
from kv_cache.entries import Entries, Entry
from kv_cache.errors import OutOfBlocksError
from kv_cache.lookup import Lookup, Match, no_tables
from kv_cache.model import state_points as points
from kv_cache.model.batch import can_go_ragged
from kv_cache.model.sequence import PagedSequence
from kv_cache.model.views import PrefixViews
from kv_cache.pages.pool import PagePool, PoolStats
from kv_cache.pages.spans import Span, as_spans
from kv_cache.residents import Residents
from kv_cache.restore import Restore
from kv_cache.room import Room
from kv_cache.saving import Saving
from kv_cache.stats import ManagerStats
from kv_cache.tiers.base import Tier
from kv_cache.tiers.store.tiered import TieredStore

T = TypeVar("T")


class CacheManager:
    """Message-keyed reuse over one ``PagePool`` (one model), optionally backed by a disk store.

    Its parts, each given what it works on: ``entries`` (the entries in memory), ``residents``
    (finished sequences kept whole), ``lookup`` (finding a prompt's reuse), ``saving`` (disk
    copies), ``room`` (dropping what is kept for reuse when the pool is full), ``restore``
    (loading from disk) and ``arrays`` (named arrays kept by key)."""

    def __init__(self, pool: PagePool, store: Tier | None = None, max_resident: int = 8,
                 views: PrefixViews | None = None, max_points: int = 2 * points.K,
                 max_arrays_bytes: int = 0):
        """``max_resident``: finished sequences kept with their working buffers (least recently
        used dropped first), so that a turn continuing one of them skips gathering its pages.
        ``views``: the sequences this manager starts read shared prefixes through them (a model
        whose attention ``kv_cache.model.attention`` routes). ``max_points``: state points
        (``kv_cache.model.state_points``) kept in memory, least recently used dropped first (they
        stay on disk). ``max_arrays_bytes``: the keyed arrays kept in memory
        (``kv_cache.arrays``; the disk tier keeps them too, within its budget)."""
        self.pool = pool
        self.views = views
        self.max_points = max_points
        self.store = store
        self.stats = ManagerStats()
        self.entries = Entries(pool)
        self.residents = Residents(pool, max_resident)
        self.lookup = Lookup(pool, self.entries, store)
        self.saving = Saving(pool, store, self.stats)
        self.room = Room(pool, self.residents, self.entries, self.stats, store, self.saving)
        self.restore = Restore(pool, store, self.stats, self.room.with_room)
        self.arrays = KeptArrays(store, max_arrays_bytes, self.saving.submit)

    # -- what it holds --------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str) -> Entry | None:
        return self.entries.get(key)

    def keys(self) -> list[str]:
        return list(self.entries)

    @property
    def has_state(self) -> bool:
        """Whether the model keeps a recurrent state (which cannot be rewound: a sequence resumes
        only where a snapshot of it was kept)."""
        return self.pool.spec.has_state

    def can_go_ragged(self) -> bool:
        """Whether passes over this manager's sequences can be ragged
        (``kv_cache.hooks.ragged_caches``)."""
        return can_go_ragged(self.pool)

    def pool_stats(self) -> PoolStats:
        """What the page pool holds now (no wait for disk writes, unlike ``report``)."""
        return self.pool.stats()

    def resident_tokens(self) -> int:
        return self.residents.tokens()

    def resident_blocks(self) -> list[int]:
        """The pages the resident sequences hold (each is one more holder of its pages)."""
        return self.residents.blocks()

    # -- starting a sequence --------------------------------------------------------------------

    def find(self, prompt: Sequence[int], keys: Iterable[str],
             boundaries: Sequence[int] = (), spans: Sequence[Span] = ()) -> Match:
        """The longest verified reuse for ``prompt`` with image ``spans`` (``Lookup.find``)."""
        return self.lookup.find(prompt, keys, boundaries, spans)

    def start(
        self, prompt: Sequence[int], keys: Iterable[str] = (), use_cache: bool = True,
        boundaries: Sequence[int] = (), spans: Sequence[Span] = ()
    ) -> tuple[PagedSequence, Match]:
        """A sequence that holds the reusable prefix of ``prompt``; the caller runs the rest.
        ``boundaries``: the prompt's message boundaries (``state_points.boundaries``); a model
        with recurrent state resumes from the last one it holds a state at, and the sequence
        snapshots its state at those after the reuse (``seq.points``: the caller stops its
        prompt pieces there), saved with the next ``save`` of it. ``spans``: the prompt's image
        spans, ``(start, length, image hash)`` each (``kv_cache.pages.spans``): a reuse holds
        only where the stored images are the same in the same places, never ends inside an
        image, and the sequence's pages and entries carry them."""
        spans = as_spans(spans)
        if not use_cache:
            return self.new_sequence(spans), Match(0, no_tables(self.pool), "none")
        match = self.lookup.find(prompt, keys, boundaries, spans)
        resident = self.residents.take(prompt, match.tokens, spans)
        if resident is not None:
            self.stats.hits += 1
            self.stats.tokens_served += len(resident.tokens)
            self._plan_points(resident, boundaries, len(prompt))
            return resident, Match(len(resident.tokens), [list(t.blocks) for t in resident.tables],
                                   "resident")
        loaded: list[list[int | None]] = []
        if match.stored is not None or match.found is not None:
            match.tokens, loaded, match.state = \
                self.restore.load(match.stored, match.tokens) if match.stored is not None \
                else self.restore.load_found(match.found, prompt, spans)
            match.tables = loaded
            if match.tokens == 0:
                match.source = "none"
        elif match.source.startswith("entry:"):
            self.entries.touch(match.source[6:])
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
                            match.tables if match.tokens else [], match.state, self.views, spans)
        for t in loaded:  # the sequence holds them now
            self.pool.release_all(t)
        self._plan_points(seq, boundaries, len(prompt))
        return seq, match

    def new_sequence(self, spans: Sequence[Span] = ()) -> PagedSequence:
        """An empty sequence (no reuse) for a prompt with image ``spans``."""
        return PagedSequence(self.pool, views=self.views, spans=spans)

    def _plan_points(self, seq: PagedSequence, boundaries: Sequence[int], end: int) -> None:
        """``seq`` (a prompt running to ``end``) snapshots its state at ``choose``'s points."""
        if self.pool.spec.has_state and boundaries:
            seq.points.plan(points.choose(boundaries, len(seq.tokens), end))

    def share_prefixes(self) -> None:
        """Sequences started from now on read their leading full pages through shared prefix
        views (``kv_cache.model.attention``). Only for a model whose attention that module
        routes and whose batched passes agree with single ones: the caller has checked."""
        if self.views is None:
            self.views = PrefixViews(self.pool)

    # -- keeping a finished sequence ------------------------------------------------------------

    def keep(self, seq: PagedSequence) -> None:
        """Keep ``seq`` (finished) resident with its working buffers: a request that continues
        it goes on from it without gathering its pages. The least recently used resident
        sequence beyond ``max_resident`` is closed. A sequence whose new positions do not fit
        in the pool is closed instead (it could not be verified against its pages later)."""
        try:
            self.room.with_room(seq.commit)
        except OutOfBlocksError:
            seq.close()
            return
        self.residents.keep(seq)

    def save(self, key: str, seq: PagedSequence, n_tokens: int | None = None) -> Entry:
        """Keep the first ``n_tokens`` (default all) of ``seq`` under ``key``, with the recurrent
        state when that is where the sequence stands; the disk copy is written by the next
        ``flush()``."""
        self.room.with_room(seq.commit)
        n = len(seq.tokens) if n_tokens is None else n_tokens
        self._save_points(seq, n)
        state = seq.state_snapshot() if n == len(seq.tokens) else None
        entry = self.entries.keep(key, seq, n, state)
        if n > 0:
            self.saving.add(entry)
        return entry

    def _save_points(self, seq: PagedSequence, n: int) -> None:
        """Keep the state snapshots ``seq`` took at or before ``n`` as entries of their own:
        one already held is only refreshed, one already on disk is not written again; beyond
        ``max_points`` in memory, the least recently used go (from memory only)."""
        taken = seq.points.take(n)
        for (p, snap), key in zip(taken, points.point_keys(seq.tokens, [p for p, _ in taken])):
            if key in self.entries:
                self.entries.touch(key)
            else:
                self.saving.add(self.entries.keep(key, seq, p, snap), again=False)
        self.entries.trim_points(self.max_points)

    def flush(self) -> None:
        """Hand pending entries to the disk writer (call once the answer is out)."""
        self.saving.flush()

    def sync(self) -> None:
        """Wait for every write handed to the disk writer (for a consistent view of the disk)."""
        self.saving.sync()

    def close(self) -> None:
        """Close the resident sequences, finish the disk writes and close the store."""
        self.residents.close_all(newest_first=True)
        self.saving.close()

    def drop(self, key: str, from_disk: bool = True) -> bool:
        """Forget ``key`` in memory (and on disk unless told otherwise)."""
        in_memory = self.entries.drop(key)
        if from_disk and self.store is not None:
            self.saving.sync()  # a queued write of this key must not bring it back
        on_disk = bool(from_disk and self.store is not None and self.store.delete(key))
        return in_memory or on_disk

    def clear(self) -> None:
        for key in list(self.entries):
            self.entries.drop(key)

    # -- keyed arrays ---------------------------------------------------------------------------

    def get_arrays(self, key: str) -> dict[str, mx.array] | None:
        """The named arrays kept under ``key`` (``put_arrays``): from memory, else from disk,
        bit for bit as put; None when neither keeps them (``kv_cache.arrays``)."""
        return self.arrays.get(key)

    def put_arrays(self, key: str, arrays: Mapping[str, mx.array]) -> None:
        """Keep ``arrays`` under ``key`` in memory and (written off this thread) on disk."""
        self.arrays.put(key, arrays)

    def arrays_bytes(self) -> int:
        """The bytes of the keyed arrays held in memory now."""
        return self.arrays.nbytes

    def has_arrays(self, key: str) -> bool:
        """Whether arrays are kept under ``key``, in memory or on disk (no file read)."""
        return self.arrays.has(key)

    # -- memory ---------------------------------------------------------------------------------

    def make_room(self, n_pages: int, group: int = 0) -> bool:
        """Drop what is kept for reuse until the pool can allocate ``n_pages`` of ``group``
        (``Room.make_room``); whether anything was dropped."""
        return self.room.make_room(n_pages, group)

    def with_room(self, fn: Callable[[], T]) -> T:
        """``fn()``, which takes pages, tried again after ``make_room`` each time the pool runs
        out (``Room.with_room``)."""
        return self.room.with_room(fn)

    def shed(self) -> int:
        """Give back the memory nothing running needs: the keyed arrays held in memory first
        (computed again, or read from disk, when asked), then what ``Room.shed`` gives back;
        the pages freed."""
        self.arrays.clear()
        return self.room.shed()

    # -- reports --------------------------------------------------------------------------------

    def report(self) -> dict:
        """Counters and sizes of both tiers, as plain values (after the pending disk writes)."""
        self.sync()
        m, s = self.stats, self.pool.stats()
        ram = {"entries": len(self), "pages": s.used_pages, "pages_held": s.held_pages,
               "pages_cached": s.cached_pages, "bytes": s.used_bytes,
               "bytes_shared": s.shared_bytes, "budget_bytes": s.budget_bytes,
               "page_size": s.page_size,
               "resident_sequence_tokens": self.resident_tokens(),
               "prefix_view_bytes": self.views.nbytes if self.views else 0,
               "evictions": s.evictions}
        return {"hits": m.hits, "misses": m.misses, "tokens_served": m.tokens_served,
                "disk_hits": m.disk_hits, "tokens_from_disk": m.tokens_from_disk,
                "pages_read_from_disk": m.pages_read_from_disk, "disk_saves": m.disk_saves,
                "disk_save_failures": m.disk_save_failures, "ram": ram,
                "disk": asdict(self.store.stats()) if self.store is not None else None,
                "disk_enabled": self.store is not None, "arrays": self.arrays.stats(),
                "store": asdict(self.store.shared.stats())
                if isinstance(self.store, TieredStore) else None}

    def describe(self, key: str) -> dict | None:
        """``key``'s entry: its tokens, pages and tiers; None when neither tier holds it."""
        self.sync()
        entry = self.get(key)
        stored = self.store.get(key) if self.store is not None else None
        if entry is None and stored is None:
            return None
        n, P = len(entry.tokens if entry is not None else stored.tokens), self.pool.page_size
        return {"tokens": n, "in_memory": entry is not None, "on_disk": stored is not None,
                "page_size": P, "pages": -(-n // P)}

    @contextmanager
    def holding(self, key: str) -> Iterator[tuple[tuple[int, ...], list, list | None,
                                                  tuple[Span, ...]] | None]:
        """``(tokens, tables, state, spans)`` of ``key``'s whole entry, its pages held while the
        block runs (an entry in memory holds its own; one loaded from disk is held for the
        block): from memory, else from disk. None where neither has all of it (a model with
        recurrent state needs the state after its last token too)."""
        self.sync()
        entry = self.get(key)
        tables: list = []
        if entry is not None:
            found = (entry.tokens, entry.tables, entry.state, entry.spans)
        else:
            stored = self.store.get(key) if self.store is not None else None
            n, tables, state = (0, [], None) if stored is None else \
                self.restore.load(stored, len(stored.tokens))
            found = (stored.tokens, tables, state, stored.spans) \
                if n and n == len(stored.tokens) else None
        if found is not None and self.pool.spec.has_state and found[2] is None:
            found = None
        try:
            yield found
        finally:
            for t in tables:
                self.pool.release_all(t)
