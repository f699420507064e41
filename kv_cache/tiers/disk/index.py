"""The disk store's in-memory index and accounting: which entries, page files and tail files
exist, how many entries reference each file, which file holds each entry's open tail page, the
keyed arrays files (``arrays``), the bytes they all take against the budget, and eviction in
policy order, entries and arrays files alike (the start-up scan that builds all of it from file
headers alone is ``scan``).

A ``DiskStore`` holds one ``StoreIndex`` and uses it under its lock; the index touches files
only to remove what it no longer references (through the store's folders, ``StoreDirs``), and
it keeps the store's counters (``DiskStats``). Every entry's token ids, layout and page hashes
live in the index (built from headers at start-up, updated on every save and eviction), so
asking whether the store holds a key, and what its tokens are, reads no file; a manifest is
read again only when its entry is loaded. Entries are also indexed by where they end
(``end_parent``), so that a prompt finds the entries it contains by its own page hashes
(``lookup``).

An entry's open tail page (per group) is held by one stored file: among the pages and tails with
the tail's parent whose tokens begin with the entry's tail tokens, a full page first, else the
longest tail. When a file is stored that continues a tail file, the entries that tail held move
to the new file and the tail file goes, so a page's bytes are on disk once however many entries
end inside it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Collection, Sequence

import numpy as np

from kv_cache.errors import ForeignError
from kv_cache.pages.events import MEDIUM_DISK, CacheEvents, StoredPage
from kv_cache.pages.eviction import EvictionPolicy
from kv_cache.pages.hashing import chain_hashes
from kv_cache.pages.spans import Extra, Span, head_extras, page_extras
from kv_cache.tiers.disk import atomic_fs as afs
from kv_cache.tiers.disk import file_format as fmt

if TYPE_CHECKING:
    from kv_cache.tiers.disk.dirs import StoreDirs

log = logging.getLogger("kv_cache.tiers.disk.store")

_UNREADABLE = (errno.EACCES, errno.EPERM)


@dataclass(slots=True)
class DiskStats:
    """The disk tier's counters (``DiskStore.stats``); ``dataclasses.asdict`` of it is what the
    server shows as ``disk`` (``/v1/kv_cache/stats``, ``/metrics``)."""

    entries: int = 0
    pages: int = 0  # full page files
    tail_pages: int = 0  # tail files
    bytes_on_disk: int = 0
    budget: int = 0
    policy: str = ""
    puts: int = 0
    refused: int = 0  # puts that did not fit (or whose entry cannot be written)
    evictions: int = 0
    corrupt_files_removed: int = 0
    foreign_files_removed: int = 0
    temp_files_removed: int = 0
    errors: int = 0
    arrays: int = 0  # keyed arrays files (``arrays``)
    arrays_bytes: int = 0


@dataclass(slots=True)
class IndexedEntry:  # the in-memory index of one manifest
    key: str
    name: str
    page_hashes: tuple[bytes, ...]
    tail_tokens: int
    size: int
    id: int
    tokens: np.ndarray  # int32 where every id fits (4 bytes a token), else int64
    layout: tuple[tuple[int, int], ...]
    has_state: bool
    tails: tuple[bytes | None, ...] = ()  # per group, the file holding its open tail page
    head_sum: bytes = b""  # framing.head_digest of its header: a load parses its metadata once
    end: bytes = b""  # group 0's chain hash of the page it ends in (``end_parent``)
    spans: tuple[Span, ...] = ()  # the image spans among its tokens (``pages.spans``)

    @property
    def files(self) -> set[bytes]:
        """Every page and tail file the entry references."""
        return set(self.page_hashes).union(h for h in self.tails if h is not None)


@dataclass(slots=True)
class FileInfo:  # a page or tail file's identity, from its header
    parent: bytes
    tokens: np.ndarray
    group: int
    partial: bool  # a tail file (tails/), else a full page (pages/)
    checksum: str = ""  # the data's, as the header says
    head_sum: bytes = b""  # framing.head_digest of the header: a restore parses no header again
    extras: tuple[Extra, ...] = ()  # its image keys (``pages.spans.page_extras``)


def token_array(tokens: Sequence[int]) -> np.ndarray:
    """Token ids compactly: int32 when they fit, else int64."""
    a = np.asarray(tokens, dtype=np.int64)
    if a.size == 0 or (a.min() >= -(1 << 31) and a.max() < (1 << 31)):
        a = a.astype(np.int32)
    a.flags.writeable = False
    return a


def end_parent(geo: fmt.Geometry, tokens: Sequence[int], page_hashes: Sequence[bytes],
               layout: Sequence[tuple[int, int]], spans: Sequence[Span] = ()) -> bytes:
    """Where an entry ends, by content: group 0's chain hash of the last full page of its tokens
    (the root when there is none); the entries ending in one page share it."""
    full = len(tokens) // geo.page_size
    if full == 0:
        return geo.root(0)
    if layout and layout[0][1]:
        return page_hashes[layout[0][1] - 1]
    return chain_hashes(geo.root(0), tokens[: full * geo.page_size], geo.page_size,
                        spans=spans)[-1]


def entry_name(key: str) -> str:
    """The manifest's file name: a hash of the key, never the key itself (docs/ARCHITECTURE.md, invariant 7)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest() + ".safetensors"


class StoreIndex:
    """Entries, page files, reference counts and bytes of a ``DiskStore``."""

    def __init__(self, geo: fmt.Geometry, dirs: StoreDirs, max_bytes: int,
                 policy: EvictionPolicy):
        self.geo, self.dirs, self.max_bytes, self.policy = geo, dirs, max_bytes, policy
        self.entries: OrderedDict[str, IndexedEntry] = OrderedDict()  # least recent first
        self.by_id: dict[int, str] = {}
        self.pages: dict[bytes, int] = {}  # present page and tail files: hash -> size
        self.info: dict[bytes, FileInfo] = {}  # their parents, tokens, groups
        self.kids: dict[bytes, set[bytes]] = {}  # parent hash -> the files it is parent of
        self.holds: dict[bytes, set[str]] = {}  # tail-holding file -> the entries it holds
        self.ends: dict[bytes, set[str]] = {}  # where entries end (``end_parent``)
        self.refs: Counter[bytes] = Counter()  # entries referencing each page or tail file
        # keyed arrays files (``arrays``): name -> (size, policy id), least recent first
        self.arrays: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.arrays_by_id: dict[int, str] = {}
        self.nbytes = 0  # of every indexed file
        self.counts = DiskStats(budget=max_bytes, policy=policy.name)  # the counters
        self.clock = 0  # the last mtime given (``tick``): an entry's recency
        self.events: CacheEvents | None = None  # told of full page files landed and gone
        self._next_id = 0

    def stats(self) -> DiskStats:
        """The counters with the index's sizes, as a copy."""
        tails = sum(1 for f in self.info.values() if f.partial)
        return replace(self.counts, entries=len(self.entries), pages=len(self.pages) - tails,
                       tail_pages=tails, bytes_on_disk=self.nbytes, arrays=len(self.arrays),
                       arrays_bytes=sum(size for size, _ in self.arrays.values()))

    def fits_after_evicting_all(self, old, protected, needed, add, gone=()) -> bool:
        """``gone``: tail files that the put's new files continue (they go after it)."""
        refs, free = Counter(self.refs), 0
        going = [e for k, e in self.entries.items() if k not in protected]
        for e in going + ([old] if old is not None else []):
            free += e.size
            refs.subtract(e.files)
        free += sum(s for h, s in self.pages.items()
                    if (refs[h] <= 0 or h in gone) and h not in needed)
        free += sum(size for size, _ in self.arrays.values())  # keyed arrays go too
        return self.nbytes - free + add <= self.max_bytes

    def projected(self, old, needed, add, gone=()) -> int:
        """Bytes after this put if nothing more were evicted."""
        b = self.nbytes + add - sum(self.pages.get(h, 0) for h in gone)
        if old is not None:
            b -= old.size + sum(self.pages.get(h, 0) for h in old.files
                                if self.refs[h] == 1 and h not in needed and h not in gone)
        return b

    def evict_one(self, protected: Collection[str], keep: Collection[bytes] = ()) -> bool:
        """Evict the policy's victim among entries not ``protected`` and keyed arrays files;
        False if none could go."""
        vid = self.policy.victim(lambda i: i in self.arrays_by_id
                                 or self.by_id.get(i) not in protected)
        if vid is None:
            return False
        if vid in self.arrays_by_id:
            name = self.arrays_by_id[vid]
            if not afs.unlink(self.dirs.arrays_fd, name):
                self.policy.insert(vid, ident=name)
                return False
            self.forget_arrays(name, in_policy=False)
            self.counts.evictions += 1
            return True
        key = self.by_id[vid]
        if not self.drop_entry(key, keep=keep):
            self.policy.insert(vid, ident=key)  # still on disk: still a candidate
            return False
        self.counts.evictions += 1
        return True

    def tick(self) -> int:
        self.clock = max(time.time_ns(), self.clock + 1)
        return self.clock

    def add_entry(self, key: str, name: str, info: fmt.EntryMetaInfo, size: int,
                  head_sum: bytes = b"") -> None:
        """Index a manifest just written or read (``head_sum``: its header's digest) as the
        most recently used entry."""
        tokens = token_array(info.tokens)
        tail = tokens[len(tokens) - info.tail_tokens:] if info.tail_tokens else tokens[:0]
        extras = page_extras(info.spans, len(tokens) - len(tail), len(tail))
        holders = tuple(self.holder(g, parent, tail, extras) for g, parent in
                        enumerate(info.tail_parents)) if info.tail_tokens else ()
        e = IndexedEntry(key, name, tuple(info.page_hashes), info.tail_tokens, size,
                         self._next_id, tokens, tuple(info.layout), info.has_state, holders,
                         head_sum, end_parent(self.geo, tokens, info.page_hashes, info.layout,
                                              info.spans), info.spans)
        self._next_id += 1
        self.ends.setdefault(e.end, set()).add(key)
        self.entries[key] = e
        self.entries.move_to_end(key)
        self.by_id[e.id] = key
        self.refs.update(e.files)
        for h in holders:
            if h is not None:
                self.holds.setdefault(h, set()).add(key)
        self.nbytes += size
        self.policy.insert(e.id, ident=key)

    def forget_entry(self, e: IndexedEntry) -> None:
        del self.entries[e.key]
        del self.by_id[e.id]
        self.policy.remove(e.id)
        self.refs.subtract(e.files)
        ends = self.ends[e.end]
        ends.discard(e.key)
        if not ends:
            del self.ends[e.end]
        for h in e.tails:
            if h is not None and h in self.holds:
                self.holds[h].discard(e.key)
                if not self.holds[h]:
                    del self.holds[h]
        self.nbytes -= e.size

    # -- keyed arrays files (``arrays``) --------------------------------------------------------

    def add_arrays(self, name: str, size: int) -> None:
        """Index an arrays file just written or found as the most recently used."""
        i = self._next_id
        self._next_id += 1
        self.arrays[name] = (size, i)
        self.arrays_by_id[i] = name
        self.nbytes += size
        self.policy.insert(i, ident=name)

    def forget_arrays(self, name: str, in_policy: bool = True) -> None:
        size, i = self.arrays.pop(name)
        del self.arrays_by_id[i]
        if in_policy:
            self.policy.remove(i)
        self.nbytes -= size

    def touch_arrays(self, name: str) -> bool:
        """An arrays file was read: the most recently used. Whether it is indexed."""
        got = self.arrays.get(name)
        if got is None:
            return False
        self.arrays.move_to_end(name)
        self.policy.access(got[1])
        return True

    # -- files and open tail pages --------------------------------------------------------------

    def file_landed(self, h: bytes, size: int, info: FileInfo) -> None:
        self.pages[h] = size
        self.nbytes += size
        self.info[h] = info
        self.kids.setdefault(info.parent, set()).add(h)
        if self.events is not None and not info.partial:
            self.events.stored(MEDIUM_DISK, [self.stored_page(h, info)])

    def stored_page(self, h: bytes, f: FileInfo) -> StoredPage:
        """Full page file ``h`` as ``events`` is told of it."""
        parent = None if f.parent == self.geo.root(f.group) else f.parent
        return StoredPage(h, parent, tuple(map(int, f.tokens)), f.extras, f.group)

    def holder(self, group: int, parent: bytes, tail: np.ndarray,
               extras: Sequence[Extra] = ()) -> bytes | None:
        """The stored file that holds an open tail page (with image keys ``extras``): a full
        page first, else the longest tail file; None when no file holds it."""
        best, rank = None, None
        n = len(tail)
        for h in self.kids.get(parent, ()):
            f = self.info[h]
            if f.group == group and len(f.tokens) >= n and np.array_equal(f.tokens[:n], tail) \
                    and head_extras(f.extras, n) == tuple(extras):
                r = (not f.partial, len(f.tokens), h)
                if rank is None or r > rank:
                    best, rank = h, r
        return best

    def continued(self, h: bytes, f: FileInfo) -> list[bytes]:
        """The tail files that file ``h`` (``f``) continues: shorter, same parent, a prefix."""
        out = []
        for x in self.kids.get(f.parent, ()):
            o = self.info[x]
            if x != h and o.partial and o.group == f.group and len(o.tokens) < len(f.tokens) \
                    and np.array_equal(f.tokens[: len(o.tokens)], o.tokens) \
                    and head_extras(f.extras, len(o.tokens)) == o.extras:
                out.append(x)
        return out

    def supersede(self, h: bytes) -> None:
        """File ``h`` has landed: the entries whose tails a shorter tail file holds, that ``h``
        continues, move to ``h``, and the shorter file goes."""
        f = self.info.get(h)
        if f is None:
            return
        for x in self.continued(h, f):
            for key in self.holds.pop(x, set()):
                e = self.entries[key]
                e.tails = tuple(h if t == x else t for t in e.tails)
                self.refs[x] -= 1
                self.refs[h] += 1
                self.holds.setdefault(h, set()).add(key)
            self.gc([x])

    def drop_entry(self, key: str, keep: Collection[bytes] = ()) -> bool:
        """Remove an entry's manifest, then the pages only it referenced (a crash in between
        leaves orphan pages, which start-up removes)."""
        e = self.entries[key]
        if not afs.unlink(self.dirs.entries_fd, e.name):
            return False
        self.forget_entry(e)
        self.gc(e.files, keep)
        return True

    def gc(self, hashes, keep: Collection[bytes] = ()) -> None:
        """Delete the page and tail files among ``hashes`` that no entry references."""
        for h in hashes:
            if self.refs[h] <= 0:
                self.refs.pop(h, None)
                if h in self.pages and h not in keep:
                    self.on_page_file(h, afs.unlink)

    def _dir_of(self, h: bytes) -> int:
        """The directory (pages or tails) of file ``h``."""
        f = self.info.get(h)
        return self.dirs.tails_fd if f is not None and f.partial else self.dirs.pages_fd

    def on_page_file(self, h: bytes, op) -> None:
        """Run ``op(dir_fd, name)`` on page or tail ``h``'s file; the index forgets the file
        when its directory is gone or ``op`` returns True (the file is gone)."""
        name = h.hex() + ".safetensors"
        try:
            sub_fd = afs.open_dir(name[:2], self._dir_of(h), create=False)
        except OSError:
            self.lost_page(h)
            return
        try:
            if op(sub_fd, name):
                self.lost_page(h)
        finally:
            os.close(sub_fd)

    def lost_page(self, h: bytes) -> None:
        self.nbytes -= self.pages.pop(h, 0)
        f = self.info.pop(h, None)
        if f is not None and not f.partial and self.events is not None:
            self.events.removed(MEDIUM_DISK, [h])
        if f is not None:
            kids = self.kids.get(f.parent)
            if kids is not None:
                kids.discard(h)
                if not kids:
                    del self.kids[f.parent]

    def page_file_exists(self, h: bytes) -> bool:
        name = h.hex() + ".safetensors"
        try:
            os.stat(f"{name[:2]}/{name}", dir_fd=self._dir_of(h), follow_symlinks=False)
            return True
        except OSError:
            return False

    def bad_file(self, err: Exception, dir_fd: int, name: str, what: str) -> bool:
        """Log a file that failed to read and remove it if it is bad; True if it is gone
        (drop it from the index), False on a transient error (EIO, EMFILE: a miss for now)."""
        if isinstance(err, FileNotFoundError):
            log.warning("disk store: %s %s vanished", what, name[:16])
            return True
        if isinstance(err, OSError) and err.errno not in _UNREADABLE:
            self.counts.errors += 1
            log.warning("disk store: %s %s not readable now: %s", what, name[:16], err)
            return False
        kind = "foreign" if isinstance(err, ForeignError) else "corrupt"
        removed = afs.unlink(dir_fd, name)
        if kind == "foreign":
            self.counts.foreign_files_removed += removed
        else:
            self.counts.corrupt_files_removed += removed
        log.warning("disk store: %s %s %s (%s)%s", kind, what, name[:16], err,
                    "; removed" if removed else "; could not remove it")
        return True
