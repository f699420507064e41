"""A persistent, content-addressed store of KV pages with message-keyed entries and a byte budget:
the disk tier (``kv_cache.tiers.base.Tier``).

Layout under ``root`` (one store, one model per root; a lock file keeps out a second store):

    pages/<hh>/<hash hex>.safetensors     a sealed page, written once, shared by every entry
    tails/<hh>/<hash hex>.safetensors     an open tail page (1..P-1 tokens after a parent hash),
                                          written once, shared by every entry ending inside it
    entries/<sha256(key) hex>.safetensors an entry: its tokens and page hashes (metadata) and its
                                          recurrent state; the key lives only in metadata
    arrays/<sha256(key) hex>.safetensors  a key's named arrays (``arrays``: what a user keeps
                                          by a key of its own), in the budget with the entries
    .lock                                 held (flock) while a store has the root open

Files are described in ``file_format``; the invariants cited are those of docs/ARCHITECTURE.md.
Every write is a temp file, fsync, rename, directory fsync (invariant 5); start-up removes temp
files and indexes entries and pages from headers only (``scan``). A truncated, corrupt, foreign
or planted file is a miss: logged and removed, never an exception out of a read. After every
``put`` the files fit ``max_bytes`` (invariant 6): entries go in policy order (LRU: last put or
touch first), never the one being written nor a pinned one, and a page goes when no entry
references it. A message id never becomes a path (invariant 7).

One chat is stored once: an entry's open tail page is not in its manifest but in a file that
holds it (``index``): a full page that continues it, else a tail file, written only when no
stored file holds it (``prepare``). The prompt's entry and the answer's entry of a turn, and the
next turn's entries, share that page; a tail file that a longer tail or a full page continues
is removed once the longer file is on disk, and its entries read their tokens from the longer
one.

The store is its parts, each used under the store's lock: the root's folders (``StoreDirs``),
the in-memory index and its accounting (``StoreIndex``), lookups by content over the index
(``ContentLookup``) and the page reader (``PageReader``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from pathlib import Path
from typing import Collection, Sequence

import mlx.core as mx
import numpy as np

from kv_cache.errors import FormatError
from kv_cache.layout.spec import CacheSpec
from kv_cache.pages.eviction import make_policy
from kv_cache.pages.events import MEDIUM_DISK, CacheEvents, in_chain_order
from kv_cache.pages.spans import Span, as_spans
from kv_cache.tiers.base import FoundPrefix, LoadedEntry, PageRecord, StoredEntry
from kv_cache.tiers.disk import atomic_fs as afs
from kv_cache.tiers.disk.arrays import ArrayFiles, HostArrays
from kv_cache.tiers.disk import file_data
from kv_cache.tiers.disk import file_format as fmt
from kv_cache.tiers.disk import framing, scan
from kv_cache.tiers.disk.dirs import StoreDirs
from kv_cache.tiers.disk.index import DiskStats, IndexedEntry, StoreIndex, entry_name
from kv_cache.tiers.disk.lookup import ContentLookup
from kv_cache.tiers.disk.prepare import prepare, write_files
from kv_cache.tiers.disk.reader import PageReader

log = logging.getLogger(__name__)


def _locked(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            if self._closed:
                raise RuntimeError("the disk store is closed")
            return fn(self, *args, **kwargs)
    return wrapper


class DiskStore:
    """Pages and message-keyed entries of one model under ``root``, within ``max_bytes``."""

    def __init__(self, root: Path, *, fingerprint: str, num_layers: int | None = None,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 page_size: int, dtype: mx.Dtype | None = None, max_bytes: int,
                 policy: str = "lru", spec: CacheSpec | None = None):
        """The store of one model under ``root``: pages of the groups of ``spec`` or, without
        one, of ``num_layers`` full-attention layers of one shape in ``dtype``."""
        if spec is None:
            if any(x is None for x in (num_layers, num_kv_heads, head_dim, dtype)) \
                    or min(num_layers, num_kv_heads, head_dim) <= 0:
                raise ValueError("layers, heads, head_dim and page_size must be > 0, "
                                 "max_bytes >= 0")
            spec = CacheSpec.plain(num_layers, num_kv_heads, head_dim, dtype)
        if page_size <= 0 or max_bytes < 0:
            raise ValueError("layers, heads, head_dim and page_size must be > 0, max_bytes >= 0")
        for g in spec.groups:
            fmt.DTYPES[g.dtype]  # a dtype the store keeps (KeyError otherwise)
        self.geo = fmt.Geometry(fingerprint, page_size, spec)
        self._lock = threading.RLock()
        self._closed = True
        self.root = Path(os.path.realpath(root))
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._dirs = StoreDirs(self.root)
        self._closed = False
        self._index = StoreIndex(self.geo, self._dirs, max_bytes, make_policy(policy))
        self._lookup = ContentLookup(self._index)
        self._reader = PageReader(self.geo, self._dirs.pages_fd)
        self._arrays = ArrayFiles(self._index)
        scan.build(self._index)

    # -- find -----------------------------------------------------------------------------------

    @_locked
    def get(self, key: str) -> StoredEntry | None:
        """The entry's metadata from the in-memory index (no file is read), or None. A file
        damaged since start-up is found when the entry is loaded (``load_entry``)."""
        e = self._index.entries.get(key)
        if e is None:
            return None
        return StoredEntry(key, tuple(e.tokens.tolist()), list(e.page_hashes), e.tail_tokens,
                           e.layout, e.has_state, e.spans)

    def find_prefix(self, prompt: Sequence[int], limit: int,
                    spans: Sequence[Span] = ()) -> FoundPrefix | None:
        """The longest prefix of ``prompt[:limit]`` (with image ``spans``) that stored page and
        tail files hold (``ContentLookup.find_prefix``); None when there is none. No file is
        read."""
        with self._lock:
            if self._closed or not self.geo.spec.groups:
                return None
            return self._lookup.find_prefix(np.asarray(prompt[:limit], dtype=np.int64),
                                            as_spans(spans))

    def find_end(self, prompt: Sequence[int], limit: int,
                 spans: Sequence[Span] = ()) -> str | None:
        """The key of the longest entry whose tokens are all a prefix of ``prompt[:limit]``
        (verified token for token) with the prompt's image ``spans`` there, or None. No file
        is read."""
        with self._lock:
            if self._closed:
                return None
            return self._lookup.find_end(np.asarray(prompt[:limit], dtype=np.int64),
                                         as_spans(spans))

    @_locked
    def has_page(self, h: bytes) -> bool:
        return h in self._index.pages and not self._index.info[h].partial

    @_locked
    def keys(self) -> list[str]:
        """Every entry's key, least recently used (put or touched) first."""
        return list(self._index.entries)

    # -- load -----------------------------------------------------------------------------------

    @_locked
    def load_entry(self, key: str) -> LoadedEntry | None:
        """The entry's manifest read and verified, with its open tail pages and recurrent state;
        None when missing, corrupt or foreign (logged, the file removed)."""
        e = self._index.entries.get(key)
        if e is None:
            return None
        got = self._read_entry(e)
        if got is None:
            return None
        info, tensors = got
        e = self._index.entries[key]
        stored = StoredEntry(key, info.tokens, list(info.page_hashes), info.tail_tokens,
                             info.layout, info.has_state, info.spans)
        tails = {}
        for g, h in enumerate(e.tails):
            data = None if h is None else self._load_holder(h)
            if data is not None:
                tails[g] = data[:, :, :, : info.tail_tokens, :]
        state = None
        if info.has_state:
            state = [[tensors[f"state.{si}.{i}"] for i in range(len(s.shapes))]
                     for si, s in enumerate(self.geo.spec.states)]
        return LoadedEntry(stored, tails, state)

    @_locked
    def load_pages(self, hashes: Sequence[bytes]) -> dict[bytes, mx.array | None]:
        """Per hash, the page's data ``[layers, 2, kv_heads, page_size, head_dim]``, checksum
        verified (None when absent, truncated, corrupt or foreign: logged, the file removed),
        read and verified in parallel straight into their MLX arrays (``reader``)."""
        ix = self._index
        todo = [h for h in dict.fromkeys(hashes) if h in ix.pages and not ix.info[h].partial]
        out: dict[bytes, mx.array | None] = {h: None for h in hashes}
        found = self._reader.read([(h, ix.pages[h], ix.info[h]) for h in todo])
        for h, (_, got), ok in zip(todo, found, self._settle(todo, found)):
            out[h] = got if ok else None
        return out

    @_locked
    def load_run(self, hashes: Sequence[bytes], group: int) -> tuple[mx.array | None, int]:
        """Consecutive full pages of ``group`` read into one array (``PageReader.read_run``):
        the array and how many of the pages, from the first, it holds verified (None, 0 when
        the first is not here)."""
        ix, n = self._index, 0
        while n < len(hashes) and hashes[n] in ix.pages and not ix.info[hashes[n]].partial \
                and ix.info[hashes[n]].group == group:
            n += 1
        if n == 0:
            return None, 0
        todo = list(hashes[:n])
        arr, found = self._reader.read_run([(h, ix.pages[h], ix.info[h]) for h in todo], group)
        ok = self._settle(todo, found)
        return arr, (ok + [False]).index(False)

    def load_holder(self, h: bytes) -> mx.array | None:
        """The data of page or tail file ``h`` (all its positions); None when it is gone or
        bad (logged, the file removed)."""
        with self._lock:
            return None if self._closed else self._load_holder(h)

    # -- save and evict -------------------------------------------------------------------------

    @_locked
    def put(self, key: str, tokens: Sequence[int], pages: Sequence[PageRecord],
            pinned: Collection[str] = (), *, tails: dict | None = None,
            layout: Sequence[tuple[int, int]] | None = None, state=None,
            spans: Sequence[Span] = ()) -> bool:
        """Save ``key``: its sealed full pages in order (group after group; ``layout`` says per
        group how many leading pages are left out and how many follow), its open tail page
        per group (``tails``; a one-group store also takes it as a last record without hash),
        its recurrent ``state`` (per state slot, its arrays), if the model has one, and the
        image ``spans`` among its tokens (its pages' hashes chain over them).

        Pages already on disk are not written again. True if saved; afterwards the store is
        within ``max_bytes``, having evicted entries other than ``key`` and ``pinned``. False
        (logged, nothing half-written, nothing evicted when it cannot fit) if it does not fit or
        the disk refuses the write. Inconsistent records (hashes that do not chain over
        ``tokens``, wrong shapes, no data for a page the store lacks) are a ``ValueError``.
        """
        ix = self._index
        put = prepare(ix, key, tokens, pages, tails, layout, state, spans)
        man, new_files = put.manifest, put.new_files
        if man is None:
            return False
        name = entry_name(key)
        old = ix.entries.get(key)
        needed = {p.hash for p in new_files} | set(man.hashes) | put.held
        add = sum(p.size for p in new_files) + man.size
        gone = {x for p in new_files for x in ix.continued(p.hash, p.info)} - needed
        protected = set(pinned) | {key}
        ix.gc(list(ix.pages), keep=needed)  # orphans an earlier failure left, if any
        if not ix.fits_after_evicting_all(old, protected, needed, add, gone):
            ix.counts.refused += 1
            log.info("disk store: an entry of %d bytes does not fit %d (pinned or too big)",
                     add, ix.max_bytes)
            return False
        try:
            while ix.projected(old, needed, add, gone) > ix.max_bytes:
                if not ix.evict_one(protected, keep=needed):
                    raise OSError(errno.EACCES, "cannot remove the files of evicted entries")
            write_files(ix, new_files)
            msize = afs.atomic_write(self._dirs.entries_fd, name, man.chunks,
                                     mtime_ns=ix.tick())
        except OSError as e:
            ix.counts.errors += 1
            log.warning("disk store: could not save an entry: %s", e)
            ix.gc(list(needed))
            return False
        if old is not None:
            ix.forget_entry(old)
        ix.add_entry(key, name, fmt.EntryMetaInfo(
            key, put.tokens, man.hashes, len(put.tokens) % self.geo.page_size,
            tuple(tuple(x) for x in put.layout), state is not None, man.tail_parents,
            put.spans), msize,
            head_sum=framing.head_digest(man.chunks[0]))
        if old is not None:
            ix.gc(old.files)
        for p in new_files:  # shorter tail files these continue are no longer needed
            ix.supersede(p.hash)
        ix.counts.puts += 1
        if ix.nbytes > ix.max_bytes:
            log.warning("disk store: %d bytes over a budget of %d", ix.nbytes, ix.max_bytes)
        return True

    @_locked
    def touch(self, key: str) -> None:
        """A hit: ``key`` becomes the most recently used (persisted as the manifest's mtime)."""
        ix = self._index
        e = ix.entries.get(key)
        if e is None:
            return
        ix.entries.move_to_end(key)
        ix.policy.access(e.id)
        t = ix.tick()
        try:
            os.utime(e.name, ns=(t, t), dir_fd=self._dirs.entries_fd, follow_symlinks=False)
        except (OSError, NotImplementedError) as err:
            log.debug("disk store: touch not persisted: %s", err)

    @_locked
    def delete(self, key: str) -> bool:
        """Remove ``key`` and the pages nothing else references. True if it was there."""
        if key not in self._index.entries:
            return False
        if not self._index.drop_entry(key):
            self._index.counts.errors += 1
            log.warning("disk store: could not delete an entry")
            return False
        return True

    # -- keyed arrays (``arrays``) --------------------------------------------------------------

    @_locked
    def has_arrays(self, key: str) -> bool:
        """Whether the store keeps arrays under ``key`` (from the index: no file is read)."""
        return self._arrays.has(key)

    @_locked
    def put_arrays(self, key: str, arrays: HostArrays) -> bool:
        """Keep ``arrays`` (``host_arrays``) under ``key`` (``ArrayFiles.put``): within the
        budget, evicting in policy order with the entries; False when it does not fit or the
        disk refuses."""
        return self._arrays.put(key, arrays)

    @_locked
    def load_arrays(self, key: str) -> dict[str, mx.array] | None:
        """The arrays kept under ``key``, checked, bit for bit as written; None when none are
        kept or the file is bad (logged, removed)."""
        return self._arrays.load(key)

    # -- the store itself -----------------------------------------------------------------------

    @_locked
    def stats(self) -> DiskStats:
        return self._index.stats()

    @_locked
    def watch(self, events: CacheEvents | None) -> None:
        """Tell ``events`` of every full page file held now, then of each one stored and
        removed from now on (``kv_cache.pages.events``, as ``MEDIUM_DISK``); None: stop."""
        ix = self._index
        pages = [ix.stored_page(h, f) for h, f in ix.info.items() if not f.partial]
        if events is not None and pages:
            events.stored(MEDIUM_DISK, in_chain_order(pages))
        ix.events = events

    @_locked
    def write_note(self, name: str, data: bytes) -> bool:
        """Write a small file of the store's own (a note saying which model it holds) at its
        root (``StoreDirs.write_note``). False (logged) on failure."""
        return self._dirs.write_note(name, data)

    def close(self) -> None:
        """Release the root (and its lock). Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._reader.close()
                self._dirs.close()

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- reading files --------------------------------------------------------------------------

    def _settle(self, hashes: Sequence[bytes], found: Sequence[tuple[str, object]]) -> list[bool]:
        """Act on what the reader found (a bad file is logged and removed); per page, whether
        it was read."""
        ix, out = self._index, []
        for h, (kind, got) in zip(hashes, found):
            if kind == "nodir":
                ix.lost_page(h)
            elif kind != "ok":
                ix.on_page_file(h, lambda fd, name, err=got: ix.bad_file(err, fd, name, "page"))
            out.append(kind == "ok")
        return out

    def _read_entry(self, e: IndexedEntry):
        """(metadata, tensors) of a manifest, or None (a bad file is removed). A manifest whose
        header is byte for byte the one indexed is not parsed again: its metadata is the
        index's (its state tensors are still checked against their checksum)."""
        ix, entries_fd = self._index, self._dirs.entries_fd
        try:
            got = _read(entries_fd, e.name)
            tensors = file_data.decode_known_entry(self.geo, got, e.head_sum) \
                if len(got) == e.size else None
            if tensors is not None:
                return fmt.EntryMetaInfo(e.key, tuple(e.tokens.tolist()), list(e.page_hashes),
                                         e.tail_tokens, e.layout, e.has_state,
                                         spans=e.spans), tensors
            info, tensors = file_data.decode_entry(self.geo, got)
            if info.key != e.key:
                raise FormatError("the manifest is another key's")
        except (FormatError, OSError) as err:
            if not ix.bad_file(err, entries_fd, e.name, "manifest"):
                return None
            ix.forget_entry(e)
            ix.gc(e.files)
            return None
        # replaced behind our back by another valid manifest of the key: indexed again
        ix.forget_entry(e)
        head = got[: framing.parse_header(got, len(got)).data_start]
        ix.add_entry(e.key, e.name, info, len(got), head_sum=framing.head_digest(head))
        ix.gc(e.files)
        return info, tensors

    def _load_holder(self, h: bytes) -> mx.array | None:
        """The data of the page or tail file that holds an open tail page; None when it is
        missing or bad (logged, the file removed)."""
        ix = self._index
        f = ix.info.get(h)
        if f is None:
            return None
        if not f.partial:
            return self.load_pages([h])[h]
        name = h.hex() + ".safetensors"
        try:
            sub_fd = afs.open_dir(name[:2], self._dirs.tails_fd, create=False)
        except OSError:
            ix.lost_page(h)
            return None
        try:
            return file_data.decode_page(self.geo, _read(sub_fd, name), h, fmt.TAIL_FORMAT)
        except (FormatError, OSError) as err:
            if ix.bad_file(err, sub_fd, name, "tail"):
                ix.lost_page(h)
            return None
        finally:
            os.close(sub_fd)


def _read(dir_fd: int, name: str) -> bytes:
    """The whole file, never through a link."""
    fd, size = afs.open_regular(name, dir_fd)
    try:
        return afs.read_all(fd, size)
    finally:
        os.close(fd)
