"""The disk store's in-memory index and accounting: which entries, page files and tail files
exist, how many entries reference each file, which file holds each entry's open tail page, the
bytes they take against the budget, eviction in policy order, and the start-up scan that builds
all of it from file headers alone.

``StoreIndex`` is a part of ``DiskStore`` (it keeps the store's state and is used under the
store's lock); it touches files only to remove what the index no longer references. Every
entry's token ids, layout and page hashes live in the index (built from headers at start-up,
updated on every save and eviction), so asking whether the store holds a key, and what its
tokens are, reads no file; a manifest is read again only when its entry is loaded. Entries
are also indexed by where they end (``end_parent``), so that a prompt finds the entries it
contains by its own page hashes (``disk_lookup``).

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
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np

from kv_cache.tiers.disk import atomic_fs as afs
from kv_cache.tiers.disk import file_format as fmt
from kv_cache.errors import ForeignError, FormatError
from kv_cache.pages.hashing import chain_hashes

log = logging.getLogger("kv_cache.tiers.disk.store")

PAGE_NAME = re.compile(r"([0-9a-f]{64})\.safetensors")
ENTRY_NAME = PAGE_NAME
_HEX2 = re.compile(r"[0-9a-f]{2}")
_UNREADABLE = (errno.EACCES, errno.EPERM)


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
    head_sum: bytes = b""  # fmt.head_digest of its header: a load parses its metadata once
    end: bytes = b""  # group 0's chain hash of the page it ends in (``end_parent``)

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
    head_sum: bytes = b""  # fmt.head_digest of the header: a restore parses no header again


def token_array(tokens: Sequence[int]) -> np.ndarray:
    """Token ids compactly: int32 when they fit, else int64."""
    a = np.asarray(tokens, dtype=np.int64)
    if a.size == 0 or (a.min() >= -(1 << 31) and a.max() < (1 << 31)):
        a = a.astype(np.int32)
    a.flags.writeable = False
    return a


def end_parent(geo: fmt.Geometry, tokens: Sequence[int], page_hashes: Sequence[bytes],
               layout: Sequence[tuple[int, int]]) -> bytes:
    """Where an entry ends, by content: group 0's chain hash of the last full page of its tokens
    (the root when there is none); the entries ending in one page share it."""
    full = len(tokens) // geo.page_size
    if full == 0:
        return geo.root(0)
    if layout and layout[0][1]:
        return page_hashes[layout[0][1] - 1]
    return chain_hashes(geo.root(0), tokens[: full * geo.page_size], geo.page_size)[-1]


def entry_name(key: str) -> str:
    """The manifest's file name: a hash of the key, never the key itself (docs/ARCHITECTURE.md, invariant 7)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest() + ".safetensors"


class StoreIndex:
    """Entries, page files, reference counts and bytes of a ``DiskStore``."""

    def _fits_after_evicting_all(self, old, protected, needed, add, gone=()) -> bool:
        """``gone``: tail files that the put's new files continue (they go after it)."""
        refs, free = Counter(self._refs), 0
        going = [e for k, e in self._entries.items() if k not in protected]
        for e in going + ([old] if old is not None else []):
            free += e.size
            refs.subtract(e.files)
        free += sum(s for h, s in self._pages.items()
                    if (refs[h] <= 0 or h in gone) and h not in needed)
        return self._bytes - free + add <= self.max_bytes

    def _projected(self, old, needed, add, gone=()) -> int:
        """Bytes after this put if nothing more were evicted."""
        b = self._bytes + add - sum(self._pages.get(h, 0) for h in gone)
        if old is not None:
            b -= old.size + sum(self._pages.get(h, 0) for h in old.files
                                if self._refs[h] == 1 and h not in needed and h not in gone)
        return b

    def _evict_one(self, protected: Collection[str], keep: Collection[bytes] = ()) -> bool:
        """Evict the policy's victim among entries not ``protected``; False if none could go."""
        vid = self.policy.victim(lambda i: self._by_id.get(i) not in protected)
        if vid is None:
            return False
        key = self._by_id[vid]
        if not self._drop_entry(key, keep=keep):
            self.policy.insert(vid, ident=key)  # still on disk: still a candidate
            return False
        self._stats["evictions"] += 1
        return True

    def _tick(self) -> int:
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def _add_entry(self, key, name, info: "fmt.EntryMetaInfo", size, at_end=True,
                   head_sum: bytes = b"") -> None:
        tokens = token_array(info.tokens)
        tail = tokens[len(tokens) - info.tail_tokens:] if info.tail_tokens else tokens[:0]
        holders = tuple(self._holder(g, parent, tail) for g, parent in
                        enumerate(info.tail_parents)) if info.tail_tokens else ()
        e = IndexedEntry(key, name, tuple(info.page_hashes), info.tail_tokens, size,
                         self._next_id, tokens, tuple(info.layout), info.has_state, holders,
                         head_sum, end_parent(self.geo, tokens, info.page_hashes, info.layout))
        self._next_id += 1
        self._ends.setdefault(e.end, set()).add(key)
        self._entries[key] = e
        self._entries.move_to_end(key, last=at_end)
        self._by_id[e.id] = key
        self._refs.update(e.files)
        for h in holders:
            if h is not None:
                self._holds.setdefault(h, set()).add(key)
        self._bytes += size
        self.policy.insert(e.id, ident=key)

    def _forget_entry(self, e: IndexedEntry) -> None:
        del self._entries[e.key]
        del self._by_id[e.id]
        self.policy.remove(e.id)
        self._refs.subtract(e.files)
        ends = self._ends[e.end]
        ends.discard(e.key)
        if not ends:
            del self._ends[e.end]
        for h in e.tails:
            if h is not None and h in self._holds:
                self._holds[h].discard(e.key)
                if not self._holds[h]:
                    del self._holds[h]
        self._bytes -= e.size

    # -- files and open tail pages --------------------------------------------------------------

    def _file_landed(self, h: bytes, size: int, info: FileInfo) -> None:
        self._pages[h] = size
        self._bytes += size
        self._info[h] = info
        self._kids.setdefault(info.parent, set()).add(h)

    def _holder(self, group: int, parent: bytes, tail: np.ndarray) -> bytes | None:
        """The stored file that holds an open tail page: a full page first, else the longest
        tail file; None when no file holds it."""
        best, rank = None, None
        n = len(tail)
        for h in self._kids.get(parent, ()):
            f = self._info[h]
            if f.group == group and len(f.tokens) >= n and np.array_equal(f.tokens[:n], tail):
                r = (not f.partial, len(f.tokens), h)
                if rank is None or r > rank:
                    best, rank = h, r
        return best

    def _continued(self, h: bytes, f: FileInfo) -> list[bytes]:
        """The tail files that file ``h`` (``f``) continues: shorter, same parent, a prefix."""
        out = []
        for x in self._kids.get(f.parent, ()):
            o = self._info[x]
            if x != h and o.partial and o.group == f.group and len(o.tokens) < len(f.tokens) \
                    and np.array_equal(f.tokens[: len(o.tokens)], o.tokens):
                out.append(x)
        return out

    def _supersede(self, h: bytes) -> None:
        """File ``h`` has landed: the entries whose tails a shorter tail file holds, that ``h``
        continues, move to ``h``, and the shorter file goes."""
        f = self._info.get(h)
        if f is None:
            return
        for x in self._continued(h, f):
            for key in self._holds.pop(x, set()):
                e = self._entries[key]
                e.tails = tuple(h if t == x else t for t in e.tails)
                self._refs[x] -= 1
                self._refs[h] += 1
                self._holds.setdefault(h, set()).add(key)
            self._gc([x])

    def _drop_entry(self, key: str, keep: Collection[bytes] = ()) -> bool:
        """Remove an entry's manifest, then the pages only it referenced (a crash in between
        leaves orphan pages, which start-up removes)."""
        e = self._entries[key]
        if not afs.unlink(self._entries_fd, e.name):
            return False
        self._forget_entry(e)
        self._gc(e.files, keep)
        return True

    def _gc(self, hashes, keep: Collection[bytes] = ()) -> None:
        """Delete the page and tail files among ``hashes`` that no entry references."""
        for h in hashes:
            if self._refs[h] <= 0:
                self._refs.pop(h, None)
                if h in self._pages and h not in keep:
                    self._on_page_file(h, afs.unlink)

    def _dir_of(self, h: bytes) -> int:
        """The directory (pages or tails) of file ``h``."""
        f = self._info.get(h)
        return self._tails_fd if f is not None and f.partial else self._pages_fd

    def _on_page_file(self, h: bytes, op) -> None:
        """Run ``op(dir_fd, name)`` on page or tail ``h``'s file; the index forgets the file
        when its directory is gone or ``op`` returns True (the file is gone)."""
        name = h.hex() + ".safetensors"
        try:
            sub_fd = afs.open_dir(name[:2], self._dir_of(h), create=False)
        except OSError:
            self._lost_page(h)
            return
        try:
            if op(sub_fd, name):
                self._lost_page(h)
        finally:
            os.close(sub_fd)

    def _lost_page(self, h: bytes) -> None:
        self._bytes -= self._pages.pop(h, 0)
        f = self._info.pop(h, None)
        if f is not None:
            kids = self._kids.get(f.parent)
            if kids is not None:
                kids.discard(h)
                if not kids:
                    del self._kids[f.parent]

    def _page_file_exists(self, h: bytes) -> bool:
        name = h.hex() + ".safetensors"
        try:
            os.stat(f"{name[:2]}/{name}", dir_fd=self._dir_of(h), follow_symlinks=False)
            return True
        except OSError:
            return False

    def _bad_file(self, err: Exception, dir_fd: int, name: str, what: str) -> bool:
        """Log a file that failed to read and remove it if it is bad; True if it is gone
        (drop it from the index), False on a transient error (EIO, EMFILE: a miss for now)."""
        if isinstance(err, FileNotFoundError):
            log.warning("disk store: %s %s vanished", what, name[:16])
            return True
        if isinstance(err, OSError) and err.errno not in _UNREADABLE:
            self._stats["errors"] += 1
            log.warning("disk store: %s %s not readable now: %s", what, name[:16], err)
            return False
        kind = "foreign" if isinstance(err, ForeignError) else "corrupt"
        removed = afs.unlink(dir_fd, name)
        self._stats[f"{kind}_files_removed"] += removed
        log.warning("disk store: %s %s %s (%s)%s", kind, what, name[:16], err,
                    "; removed" if removed else "; could not remove it")
        return True

    def _build_index(self) -> None:
        """Index pages, tails and entries from their headers only; remove temp, bad and orphan
        files (a tail file that a longer one or a full page continues holds no entry's tail:
        an orphan)."""
        self._index_pages(self._pages_fd, fmt.PAGE_FORMAT, "page")
        self._index_pages(self._tails_fd, fmt.TAIL_FORMAT, "tail")
        found = []
        for f in self._scan(self._entries_fd):
            if ENTRY_NAME.fullmatch(f.name):
                got = self._index_file(self._entries_fd, f.name, lambda hdr: (
                    fmt.parse_entry(self.geo, hdr), hdr.digest), "manifest")
                if got is None:
                    continue
                (info, digest), size, mtime = got
                if entry_name(info.key) != f.name:
                    self._bad_file(FormatError("named for another key"), self._entries_fd,
                                   f.name, "manifest")
                    continue
                found.append((mtime, f.name, info, size, digest))
        for mtime, name, info, size, digest in sorted(found, key=lambda x: (x[0], x[1])):
            self._add_entry(info.key, name, info, size, head_sum=digest)
            self._clock = max(self._clock, mtime)
        self._gc(list(self._pages))  # orphans: pages no manifest references
        while self._bytes > self.max_bytes and self._evict_one(()):
            pass  # the budget may have shrunk since the last run

    def _index_pages(self, base_fd: int, kind: str, what: str) -> None:
        for sub in self._scan(base_fd):
            if not (_HEX2.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)):
                continue
            try:
                sub_fd = afs.open_dir(sub.name, base_fd, create=False)
            except OSError:
                continue
            try:
                for f in self._scan(sub_fd):
                    m = PAGE_NAME.fullmatch(f.name)
                    if m and m.group(1)[:2] == sub.name:
                        h = bytes.fromhex(m.group(1))
                        got = self._index_file(sub_fd, f.name, lambda hdr: (fmt.parse_page(
                            self.geo, hdr, h, kind), hdr.digest), what)
                        if got is not None:
                            (info, digest), size, _ = got
                            self._file_landed(h, size, FileInfo(
                                info.parent, token_array(info.tokens), info.group,
                                kind == fmt.TAIL_FORMAT, info.checksum, digest))
            finally:
                os.close(sub_fd)

    def _scan(self, dir_fd: int):
        """A directory's entries; temp files and planted symlinks are removed on the way."""
        try:
            items = list(os.scandir(dir_fd))
        except OSError as e:
            log.warning("disk store: cannot list a directory: %s", e)
            return []
        out = []
        for f in items:
            if f.name.startswith(afs.TMP_PREFIX):
                self._stats["temp_files_removed"] += afs.unlink(dir_fd, f.name)
            elif f.is_symlink() and (PAGE_NAME.fullmatch(f.name) or _HEX2.fullmatch(f.name)):
                log.warning("disk store: symlink %s planted in the store; removed", f.name[:16])
                self._stats["corrupt_files_removed"] += afs.unlink(dir_fd, f.name)
            else:
                out.append(f)
        return out

    def _index_file(self, dir_fd: int, name: str, parse, what: str):
        try:
            fd, size = afs.open_regular(name, dir_fd)
            try:
                hdr = fmt.read_header(fd, size)
                mtime = os.fstat(fd).st_mtime_ns
            finally:
                os.close(fd)
            return parse(hdr), size, mtime
        except (FormatError, OSError) as err:
            self._bad_file(err, dir_fd, name, what)
            return None
