"""The shared store's reads and writes: pages by hash, manifests by message id, over a ``Link``.

Reads come from the generating thread on a local miss: a manifest (one GET), which of a
prompt's pages the store holds (EXISTS in batches, stopping at the first absent one), and the
pages themselves (GETs pipelined ``batch`` pages to a round trip). Each value is checked
(``values``); a bad one is a miss, counted, and deleted. A store that fails or times out is a
miss too (the breaker then keeps it out of the way for a while).

Writes come from one background thread fed by a bounded queue (``submit``): what does not fit
is dropped and counted, so neither a token nor the disk writer ever waits on the store. An
entry's pages go first (TOUCH, then ``SET NX`` of the absent ones: a page is written once
whoever computed it, and each writer that finds it present refreshes it in the store's LRU, as
EXISTS would not), its manifest last, so a manifest never names a page that was not sent
(the store may still evict it later: a reader then gets the prefix before it).

An observer (``events``, ``kv_cache.pages.events``) is told of an entry's full pages once its write
succeeded, as ``MEDIUM_STORE``; the store's own evictions are not seen, so never told.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kv_cache.pages.events import MEDIUM_STORE, CacheEvents, StoredPage
from kv_cache.pages.hashing import chain_hashes, page_hash
from kv_cache.pages.spans import page_extras
from kv_cache.tiers.disk import file_format as fmt
from kv_cache.tiers.store import values as val
from kv_cache.tiers.store.connection import Link, StoreUnavailable

log = logging.getLogger("kv_cache.store")


@dataclass
class StoreStats:
    """The shared store tier's counters (``/v1/kv_cache/stats``, ``/metrics``, the chat page)."""

    url: str = ""
    namespace: str = ""
    breaker: str = "closed"  # closed, open (not asked), half-open (the next call is a trial)
    hits: int = 0  # lookups that found something (a manifest or a prompt's first page)
    misses: int = 0  # lookups that found nothing, or could not ask
    pages_read: int = 0
    pages_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    entries_written: int = 0
    bad_values: int = 0  # failed a check: counted as a miss and deleted
    errors: int = 0  # commands that failed or timed out
    dropped_pages: int = 0  # not written: the write queue was full
    breaker_opens: int = 0
    seconds: float = 0.0  # spent in store commands, reads and writes
    queued: int = 0  # entry writes not finished: waiting, or being written


@dataclass
class WriteJob:
    """An entry to write: host bytes only (the writer never runs MLX)."""

    key: str
    tokens: tuple[int, ...]
    pages: list  # PageRecord-like: hash, tokens, data (host array or None), group
    tails: dict = field(default_factory=dict)  # group -> host array of the open tail page
    layout: list = field(default_factory=list)
    state: list | None = None
    spans: tuple = ()  # the image spans among its tokens (``kv_cache.pages.spans``)


class SharedStore:
    """Pages and manifests of one model in one namespace of a Valkey/Redis store."""

    def __init__(self, link: Link, geo: fmt.Geometry, namespace: str = "kv", batch: int = 16,
                 max_queue: int = 8):
        self.link, self.geo, self.batch = link, geo, max(1, batch)
        self.keys = val.Keys.of(namespace, geo)
        self._stats = StoreStats(url=link.url, namespace=namespace)
        self._lock = threading.Lock()
        self._queue: queue.Queue[WriteJob | None] = queue.Queue(maxsize=max_queue)
        self.events: CacheEvents | None = None  # told of the pages of each entry written
        self._thread = threading.Thread(target=self._run, name="kv-store-writer", daemon=True)
        self._thread.start()

    # -- reads ----------------------------------------------------------------------------------

    def get_entry(self, key: str):
        """``key``'s manifest checked: (``EntryMetaInfo``, state tensors), or None."""
        name = self.keys.entry(key)
        try:
            value = self.link.call(lambda c: c.get(name))
        except StoreUnavailable:
            self._count(misses=1)
            return None
        if value is None:
            self._count(misses=1)
            return None
        try:
            got = val.check_entry(self.geo, key, value)
        except val.BadValue as e:
            self._bad(name, "manifest", e)
            self._count(misses=1)
            return None
        self._count(hits=1, bytes_read=len(value))
        return got

    def count_present(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, the store holds (EXISTS in batches of
        ``batch * 4``, stopping at the first absent page)."""
        n, step = 0, self.batch * 4
        try:
            for at in range(0, len(hashes), step):
                names = [self.keys.page(h) for h in hashes[at : at + step]]
                found = self.link.call(lambda c: _pipelined(c, "exists", names))
                for f in found:
                    if not f:
                        break
                    n += 1
                if n < at + len(names):
                    break
        except StoreUnavailable:
            pass
        self._count(hits=n > 0, misses=n == 0)
        return n

    def load_pages(self, hashes: Sequence[bytes], tail: bool = False,
                   stop: bool = True) -> list[tuple[np.ndarray, str] | None]:
        """Per hash, the page checked as storage-form numpy data and its dtype name, or None
        (absent, bad: deleted, or the store failing). ``stop``: nothing after the first that
        fails (only a prefix is of use)."""
        out: list = [None] * len(hashes)
        for at in range(0, len(hashes), self.batch):
            part = hashes[at : at + self.batch]
            names = [self.keys.page(h) for h in part]
            try:
                got = self.link.call(lambda c: _pipelined(c, "get", names))
            except StoreUnavailable:
                return out
            for i, (h, name, value) in enumerate(zip(part, names, got)):
                if value is not None:
                    try:
                        out[at + i] = val.check_page(self.geo, h, value, tail)
                        self._count(pages_read=1, bytes_read=len(value))
                        continue
                    except val.BadValue as e:
                        self._bad(name, "page", e)
                if stop:
                    return out
        return out

    def delete_entry(self, key: str) -> None:
        """Forget ``key``'s manifest (its pages stay: other entries may name them)."""
        name = self.keys.entry(key)
        try:
            self.link.call(lambda c: c.delete(name))
        except StoreUnavailable:
            pass

    # -- writes ---------------------------------------------------------------------------------

    def submit(self, job: WriteJob) -> bool:
        """Queue an entry's write; False (its pages counted as dropped) when the queue is full."""
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            self._count(dropped_pages=len(job.pages) + len(job.tails))
            log.info("kv store: write queue full, an entry of %d pages dropped", len(job.pages))
            return False

    def drain(self) -> None:
        """Wait until every queued write is done (tests, shutdown)."""
        self._queue.join()

    def write(self, job: WriteJob) -> bool:
        """Write ``job`` now: its absent pages (those with data), then its manifest."""
        P, geo = self.geo.page_size, self.geo
        parents = [chain_hashes(geo.root(g), job.tokens, P, spans=job.spans)
                   for g in range(len(geo.spec.groups))]
        at = [{h: i for i, h in enumerate(chain)} for chain in parents]
        items: list[tuple[bytes, Callable[[], bytes]]] = []
        told: list[StoredPage] = []
        for p in job.pages:
            if p.hash is not None and p.data is not None:
                i = at[p.group][bytes(p.hash)]
                parent = parents[p.group][i - 1] if i else geo.root(p.group)
                extras = page_extras(job.spans, i * P, P)
                items.append((bytes(p.hash), _page_maker(geo, p.hash, parent, p.tokens, p.data,
                                                         p.group, extras)))
                told.append(StoredPage(bytes(p.hash), parent if i else None,
                                       tuple(map(int, p.tokens)), extras, p.group))
        n_tail = len(job.tokens) % P
        for g, data in sorted(job.tails.items()):
            chain = parents[g][: len(job.tokens) // P]
            parent = chain[-1] if chain else geo.root(g)
            tail = job.tokens[len(job.tokens) - n_tail:]
            extras = page_extras(job.spans, len(job.tokens) - n_tail, n_tail)
            items.append((page_hash(parent, tail, extras), _page_maker(geo, None, parent, tail,
                                                                       data, g, extras)))
        hashes = [h for p in job.pages if p.hash is not None for h in [bytes(p.hash)]]
        manifest = val.entry_value(geo, job.key, job.tokens, hashes, job.layout, job.state,
                                   job.spans)
        # last page first: the store's LRU then drops an entry's later pages before its first
        # ones (TOUCH and SET both count as use; EXISTS does not, and a beginning that every
        # conversation shares went first), which keeps what it holds a usable prefix
        items.reverse()
        try:
            names = [self.keys.page(h) for h, _ in items]
            present = self.link.call(lambda c: _pipelined(c, "touch", names)) if names else []
            todo = [(name, make) for name, (_, make), there in zip(names, items, present)
                    if not there]
            for at in range(0, len(todo), self.batch):
                part = [(name, make()) for name, make in todo[at : at + self.batch]]
                self.link.call(lambda c: _set_nx(c, part))
                self._count(pages_written=len(part), bytes_written=sum(len(v) for _, v in part))
            self.link.call(lambda c: c.set(self.keys.entry(job.key), manifest))
        except StoreUnavailable:
            return False
        self._count(entries_written=1, bytes_written=len(manifest))
        if self.events is not None and told:
            self.events.stored(MEDIUM_STORE, told)
        return True

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self.write(job)
            except Exception:  # a bad job never stops the writer
                log.exception("kv store: writing an entry failed")
            finally:
                del job  # its pages' bytes go now, not with the next job (as saving.DiskWriter)
                self._queue.task_done()
        self._queue.task_done()

    # -- stats ----------------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**vars(self._stats))
        s.breaker = self.link.breaker.state
        s.breaker_opens = self.link.breaker.opens
        s.errors, s.seconds = self.link.errors, round(self.link.seconds, 6)
        s.queued = self._queue.unfinished_tasks  # NOTE: not qsize(): the write in progress too
        return s

    def close(self) -> None:
        """Finish the queued writes and close the link. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)
        self.link.close()

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self._stats, k, getattr(self._stats, k) + int(v))

    def _bad(self, name: str, what: str, e: Exception) -> None:
        """A value that failed a check: a miss, counted, deleted (logged, never its bytes)."""
        self._count(bad_values=1)
        log.warning("kv store: bad %s value removed (%s)", what, e)
        try:
            self.link.call(lambda c: c.delete(name))
        except StoreUnavailable:
            pass


def _page_maker(geo, h, parent, tokens, data, group, extras=()) -> Callable[[], bytes]:
    """The value of a page (with its image keys ``extras``), made when it is sent (only pages
    the store lacks are encoded)."""
    tokens = tuple(int(t) for t in tokens)
    ph = bytes(h) if h is not None else page_hash(parent, tokens, extras)
    return lambda: val.page_value(geo, ph, parent, tokens, data, group, extras)


def _pipelined(client, command: str, names: list[str]) -> list:
    pipe = client.pipeline(transaction=False)
    for name in names:
        getattr(pipe, command)(name)
    return pipe.execute()


def _set_nx(client, items: list[tuple[str, bytes]]) -> list:
    pipe = client.pipeline(transaction=False)
    for name, value in items:
        pipe.set(name, value, nx=True)
    return pipe.execute()
