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
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import mlx.core as mx

from .disk_format import host_array
from .disk_store import DiskStore, PageRecord, StoredEntry
from .errors import OutOfBlocksError
from .page_pool import PagePool
from .sequence import PagedSequence

log = logging.getLogger("kv_cache.manager")


@dataclass(slots=True)
class Entry:
    key: str
    tokens: tuple[int, ...]
    blocks: list[int]


@dataclass(slots=True)
class Match:
    tokens: int  # prompt tokens whose keys and values are reused
    blocks: list[int]
    source: str  # "entry:<key>", "disk:<key>", "prefix" or "none"
    stored: StoredEntry | None = None


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


class DiskWriter:
    """One background thread that runs disk writes in order, so saving an entry never delays
    an answer or the next request. It is handed plain host bytes: it never runs MLX."""

    def __init__(self) -> None:
        self._tasks: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def drain(self) -> None:
        """Wait until every submitted write is done."""
        self._tasks.join()

    def close(self) -> None:
        self._tasks.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except Exception:  # a disk problem never takes the server down
                log.exception("saving a cache entry to disk failed")
            finally:
                self._tasks.task_done()
        self._tasks.task_done()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class CacheManager:
    """Message-keyed reuse over one ``PagePool`` (one model), optionally backed by a disk store."""

    def __init__(self, pool: PagePool, store: DiskStore | None = None, max_resident: int = 4):
        """``max_resident``: finished sequences kept with their working buffers (least recently
        used dropped first), so that a turn continuing one of them skips gathering its pages."""
        self.pool = pool
        self.max_resident = max_resident
        self.store = store
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._pending: list[tuple] = []  # entries to write to disk, handed over by flush()
        self._writer = DiskWriter() if store is not None else None
        self._resident: OrderedDict[int, PagedSequence] = OrderedDict()  # oldest first
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
            if entry is not None:
                n = min(common_prefix(entry.tokens, prompt), limit)
                if n > best.tokens:
                    best = Match(n, entry.blocks, f"entry:{key}")
            elif self.store is not None and (stored := self.store.get(key)) is not None:
                n = min(common_prefix(stored.tokens, prompt), limit)
                if n > best.tokens:
                    best = Match(n, [], f"disk:{key}", stored)
        by_prefix = self.pool.match_prefix(prompt)
        n = min(len(by_prefix) * self.pool.page_size, limit)
        if n > best.tokens:
            best = Match(n, by_prefix, "prefix")
        best.blocks = best.blocks[: -(-best.tokens // self.pool.page_size)]
        return best

    def keep(self, seq: PagedSequence) -> None:
        """Keep ``seq`` (finished) resident with its working buffers: a request that continues
        it goes on from it without gathering its pages. The least recently used resident
        sequence beyond ``max_resident`` is closed. A sequence whose new positions do not fit
        in the pool is closed instead (it could not be verified against its pages later)."""
        try:
            seq.commit()
        except OutOfBlocksError:
            seq.close()
            return
        if self.max_resident <= 0:
            seq.close()
            return
        self._resident[id(seq)] = seq
        while len(self._resident) > self.max_resident:
            self._resident.popitem(last=False)[1].close()

    def resident_tokens(self) -> int:
        return sum(len(s.tokens) for s in self._resident.values())

    def resident_blocks(self) -> list[int]:
        """The pages the resident sequences hold (each is one more holder of its pages)."""
        return [b for s in self._resident.values() for b in s.table.blocks]

    def _take_resident(self, prompt: Sequence[int], match: Match) -> PagedSequence | None:
        best, best_n = None, 0
        for seq in self._resident.values():
            n = min(common_prefix(seq.tokens, prompt), len(prompt) - 1)
            if n > best_n and seq.layers[0].keys is not None:
                best, best_n = seq, n
        if best is None or best_n < match.tokens:
            return None
        del self._resident[id(best)]
        best.trim(len(best.tokens) - best_n)  # NOTE: verified by tokens, like any other reuse
        return best

    def _close_resident(self) -> None:
        while self._resident:
            self._resident.popitem()[1].close()

    def start(
        self, prompt: Sequence[int], keys: Iterable[str] = (), use_cache: bool = True
    ) -> tuple[PagedSequence, Match]:
        """A sequence that holds the reusable prefix of ``prompt``; the caller runs the rest."""
        if not use_cache:
            return PagedSequence(self.pool), Match(0, [], "none")
        match = self.find(prompt, keys)
        resident = self._take_resident(prompt, match)
        if resident is not None:
            self.stats.hits += 1
            self.stats.tokens_served += len(resident.tokens)
            return resident, Match(len(resident.tokens), list(resident.table.blocks), "resident")
        loaded: list[int] = []
        if match.stored is not None:
            loaded = self._load(match.stored, match.tokens)
            match.blocks = loaded
            match.tokens = min(match.tokens, len(loaded) * self.pool.page_size)
            if match.tokens == 0:
                match.source = "none"
        elif match.source.startswith("entry:"):
            self._entries.move_to_end(match.source[6:])
        if match.tokens:
            self.stats.hits += 1
            self.stats.tokens_served += match.tokens
            if match.stored is not None:
                self.stats.disk_hits += 1
                self.stats.tokens_from_disk += match.tokens
                self.store.touch(match.stored.key)
        else:
            self.stats.misses += 1
        seq = PagedSequence(self.pool, prompt[: match.tokens], match.blocks)
        for b in loaded:  # the sequence holds them now
            self.pool.release(b)
        return seq, match

    def _load(self, stored: StoredEntry, n: int) -> list[int]:
        """Hold the pages of ``stored`` that cover its first ``n`` tokens, from memory where the
        pool has them, else from disk; stops at the first page that cannot be had."""
        P, pool = self.pool.page_size, self.pool
        need = -(-n // P)
        blocks: list[int] = []
        parent = pool.root
        try:
            for i, h in enumerate(stored.page_hashes[:need]):
                block = pool.lookup(h)
                if block is not None:
                    pool.hold(block)
                else:
                    data = self.store.load_page(h)
                    if data is None:
                        return blocks
                    block = pool.add_sealed(parent, stored.tokens[i * P : (i + 1) * P], data)
                    self.stats.pages_read_from_disk += 1
                blocks.append(block)
                parent = h
            if need > len(stored.page_hashes):  # the reuse reaches into the open tail page
                tail = self.store.load_tail(stored.key)
                if tail is None:
                    return blocks
                start = len(stored.page_hashes) * P
                k = n - start
                (block,) = pool.allocate(1)
                pool.write(block, mx.contiguous(tail[:, :, :, :k, :]),
                           stored.tokens[start : start + k])
                blocks.append(block)
        except OutOfBlocksError as e:
            log.warning("memory full while loading %s from disk: %s", stored.key, e)
        return blocks

    # -- entries --------------------------------------------------------------------------------

    def save(self, key: str, seq: PagedSequence, n_tokens: int | None = None) -> Entry:
        """Keep the first ``n_tokens`` (default all) of ``seq`` under ``key``; the disk copy is
        written by the next ``flush()``."""
        seq.commit()
        n = len(seq.tokens) if n_tokens is None else n_tokens
        blocks = seq.prefix_blocks(n)
        for b in blocks:
            self.pool.hold(b)
        self.drop(key, from_disk=False)
        entry = Entry(key, tuple(seq.tokens[:n]), list(blocks))
        self._entries[key] = entry
        if self.store is not None and n > 0:
            self._pending.append(self._capture(entry))
        return entry

    def _capture(self, entry: Entry) -> tuple:
        """What the disk copy of ``entry`` needs, as references (no copy, no lock): the pages
        may be evicted from memory before the write, their arrays stay alive."""
        P, pool, n = self.pool.page_size, self.pool, len(entry.tokens)
        full = n // P
        pages = [(pool.hash_of(b), pool.tokens(b), pool.data(b)) for b in entry.blocks[:full]]
        tail = None
        if n % P:
            tail = mx.contiguous(pool.data(entry.blocks[full])[:, :, :, : n % P, :])
        return entry.key, entry.tokens, pages, tail

    def _writer_task(self, captured: tuple) -> Callable[[], None]:
        key, tokens, pages, tail = captured
        # Pages already on disk need no data; the rest go over as host bytes (zero-copy).
        records = [PageRecord(h, t, None if self.store.has_page(h) else host_array(d))
                   for h, t, d in pages]
        if tail is not None:
            records.append(PageRecord(None, tokens[len(pages) * self.pool.page_size :],
                                      host_array(tail)))

        def write() -> None:
            try:
                ok = self.store.put(key, tokens, records, pinned=(key,))
            except ValueError as e:  # e.g. a page evicted from disk since the check above
                log.info("cache entry %s not saved to disk: %s", key, e)
                ok = False
            if ok:
                self.stats.disk_saves += 1
            else:
                self.stats.disk_save_failures += 1
        return write

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
            for b in entry.blocks:
                self.pool.release(b)
        if from_disk and self.store is not None:
            self.sync()  # a queued write of this key must not bring it back
        on_disk = bool(from_disk and self.store is not None and self.store.delete(key))
        return entry is not None or on_disk

    def clear(self) -> None:
        for key in list(self._entries):
            self.drop(key, from_disk=False)

    def _reclaim(self, n_pages: int) -> None:
        while self._resident and not self.pool.can_allocate(n_pages):
            self._resident.popitem(last=False)[1].close()
        while self._entries and not self.pool.can_allocate(n_pages):
            self.drop(next(iter(self._entries)), from_disk=False)
            self.stats.entries_dropped += 1
