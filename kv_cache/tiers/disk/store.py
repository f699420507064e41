"""A persistent, content-addressed store of KV pages with message-keyed entries and a byte budget.

Layout under ``root`` (one store, one model per root; a lock file keeps out a second store):

    pages/<hh>/<hash hex>.safetensors     a sealed page, written once, shared by every entry
    tails/<hh>/<hash hex>.safetensors     an open tail page (1..P-1 tokens after a parent hash),
                                          written once, shared by every entry ending inside it
    entries/<sha256(key) hex>.safetensors an entry: its tokens and page hashes (metadata) and its
                                          recurrent state; the key lives only in metadata
    .lock                                 held (flock) while a store has the root open

Files are described in ``disk_format``; the invariants cited are those of docs/ARCHITECTURE.md.
Every write is a temp file, fsync, rename, directory fsync (invariant 5); start-up removes temp files and indexes entries and pages from headers only. A
truncated, corrupt, foreign or planted file is a miss: logged and removed, never an exception out
of a read. After every ``put`` the files fit ``max_bytes`` (invariant 6): entries go in policy
order (LRU: last put or touch first), never the one being written nor a pinned one, and a page
goes when no entry references it. A message id never becomes a path (invariant 7).

One chat is stored once: an entry's open tail page is not in its manifest but in a file that
holds it (``disk_index``): a full page that continues it, else a tail file, written only when
no stored file holds it. The prompt's entry and the answer's entry of a turn, and the next
turn's entries, share that page; a tail file that a longer tail or a full page continues is
removed once the longer file is on disk, and its entries read their tokens from the longer one.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Sequence

import mlx.core as mx

from kv_cache.tiers.disk import file_format as fmt
from kv_cache.tiers.disk import atomic_fs as afs
from kv_cache.tiers.disk.file_format import FormatError, Geometry
from kv_cache.tiers.disk.index import FileInfo, IndexedEntry, StoreIndex, entry_name, token_array
from kv_cache.tiers.disk.lookup import ContentLookup
from kv_cache.model.spec import CacheSpec
from kv_cache.pages.eviction import make_policy
from kv_cache.tiers.disk.reader import PageReader

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


@dataclass
class PageRecord:
    """A page handed to ``put``: a sealed full page (``hash`` set) or the entry's open tail."""

    hash: bytes | None  # chained content hash of a sealed full page; None for the open tail page
    tokens: tuple[int, ...]
    data: mx.array | None  # [layers, 2, kv_heads, n, head_dim]; None if the store has the page
    group: int = 0  # the cache group whose layers the page holds


@dataclass
class NewFile:
    """A page or tail file a put writes."""

    hash: bytes
    chunks: list
    size: int
    info: FileInfo


@dataclass
class StoredEntry:
    key: str  # the original message_id (lives in metadata only)
    tokens: tuple[int, ...]  # all tokens of the entry
    page_hashes: list[bytes]  # sealed full pages, in order, group after group
    tail_tokens: int  # tokens in the open tail page (0 if none)
    layout: tuple[tuple[int, int], ...] = ()  # per group: (pages not stored, pages stored)
    has_state: bool = False  # carries the recurrent state after its tokens

    def group_hashes(self) -> list[list[bytes | None]]:
        """Per group, the hash of each full page (None where the entry does not store it)."""
        out, at = [], 0
        for skip, count in self.layout or ((0, len(self.page_hashes)),):
            out.append([None] * skip + list(self.page_hashes[at : at + count]))
            at += count
        return out


@dataclass
class LoadedEntry:
    """An entry as read back from its manifest: metadata, open tail pages, recurrent state."""

    entry: StoredEntry
    tails: dict[int, mx.array]  # per group (empty when the entry ends on a page boundary)
    state: list[list[mx.array]] | None  # per state slot, its arrays


class DiskStoreLockedError(RuntimeError):
    """Another DiskStore (this process or another) has the root open."""


def _locked(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            if self._closed:
                raise RuntimeError("the disk store is closed")
            return fn(self, *args, **kwargs)
    return wrapper


class DiskStore(StoreIndex, ContentLookup):
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
        self.geo = Geometry(fingerprint, page_size, spec)
        self.page_size, self.max_bytes = page_size, max_bytes
        self.dtype = spec.groups[0].mx_dtype if spec.groups else None
        self.policy = make_policy(policy)
        self._lock = threading.RLock()
        self._closed = True
        self.root = Path(os.path.realpath(root))
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._root_fd = afs.open_dir(str(self.root), None, create=False)
        self._fds = [self._root_fd]
        try:
            self._lock_fd = self._take_lock()
            self._entries_fd = afs.open_dir("entries", self._root_fd, create=True)
            self._fds.append(self._entries_fd)
            self._pages_fd = afs.open_dir("pages", self._root_fd, create=True)
            self._fds.append(self._pages_fd)
            self._tails_fd = afs.open_dir("tails", self._root_fd, create=True)
            self._fds.append(self._tails_fd)
        except BaseException:
            self._close_fds()
            raise
        self._closed = False
        self._entries: OrderedDict[str, IndexedEntry] = OrderedDict()  # least recent first
        self._by_id: dict[int, str] = {}
        self._pages: dict[bytes, int] = {}  # present page and tail files: hash -> size
        self._info: dict[bytes, FileInfo] = {}  # their parents, tokens, groups
        self._kids: dict[bytes, set[bytes]] = {}  # parent hash -> the files it is parent of
        self._holds: dict[bytes, set[str]] = {}  # tail-holding file -> the entries it holds
        self._ends: dict[bytes, set[str]] = {}  # where entries end (disk_index.end_parent)
        self._refs: Counter[bytes] = Counter()  # entries referencing each page or tail file
        self._bytes = 0
        self._next_id = 0
        self._clock = 0
        self._stats = Counter()
        self._reader = PageReader(self.geo, self._pages_fd)
        self._build_index()

    # -- public API -----------------------------------------------------------------------------

    @_locked
    def write_note(self, name: str, data: bytes) -> bool:
        """Write a small file of the store's own (a note saying which model it holds) at its
        root, after removing temp files a crash left there. A temp file and a rename: a link
        planted under ``name`` is replaced, never written through. False (logged) on failure."""
        if not name or "/" in name or name.startswith(".") or name in ("entries", "pages",
                                                                       "tails"):
            raise ValueError(f"not a note name: {name!r}")
        try:
            for f in os.listdir(self._root_fd):  # a write that a crash cut short
                if f.startswith(afs.TMP_PREFIX):
                    afs.unlink(self._root_fd, f)
            afs.atomic_write(self._root_fd, name, [data])
            return True
        except OSError as e:
            log.warning("disk store: could not write %s: %s", name, e)
            return False

    @_locked
    def has_page(self, h: bytes) -> bool:
        return h in self._pages and not self._info[h].partial

    @_locked
    def put(self, key: str, tokens: Sequence[int], pages: Sequence[PageRecord],
            pinned: Collection[str] = (), *, tails: dict | None = None,
            layout: Sequence[tuple[int, int]] | None = None, state=None) -> bool:
        """Save ``key``: its sealed full pages in order (group after group; ``layout`` says per
        group how many leading pages are left out and how many follow), its open tail page
        per group (``tails``; a one-group store also takes it as a last record without hash)
        and its recurrent ``state`` (per state slot, its arrays), if the model has one.

        Pages already on disk are not written again. True if saved; afterwards the store is
        within ``max_bytes``, having evicted entries other than ``key`` and ``pinned``. False
        (logged, nothing half-written, nothing evicted when it cannot fit) if it does not fit or
        the disk refuses the write. Inconsistent records (hashes that do not chain over
        ``tokens``, wrong shapes, no data for a page the store lacks) are a ``ValueError``.
        """
        tokens, new_pages, manifest, layout, held = self._prepare(key, tokens, pages, tails,
                                                                  layout, state)
        if manifest is None:
            return False
        name = entry_name(key)
        old = self._entries.get(key)
        needed = {p.hash for p in new_pages} | set(manifest[1]) | held
        add = sum(p.size for p in new_pages) + manifest[2]
        gone = {x for p in new_pages for x in self._continued(p.hash, p.info)} - needed
        protected = set(pinned) | {key}
        self._gc(list(self._pages), keep=needed)  # orphans an earlier failure left, if any
        if not self._fits_after_evicting_all(old, protected, needed, add, gone):
            self._stats["refused"] += 1
            log.info("disk store: an entry of %d bytes does not fit %d (pinned or too big)",
                     add, self.max_bytes)
            return False
        try:
            while self._projected(old, needed, add, gone) > self.max_bytes:
                if not self._evict_one(protected, keep=needed):
                    raise OSError(errno.EACCES, "cannot remove the files of evicted entries")
            self._write_pages(new_pages)
            chunks, hashes, _, _ = manifest
            msize = afs.atomic_write(self._entries_fd, name, chunks, mtime_ns=self._tick())
        except OSError as e:
            self._stats["errors"] += 1
            log.warning("disk store: could not save an entry: %s", e)
            self._gc(list(needed))
            return False
        if old is not None:
            self._forget_entry(old)
        self._add_entry(key, name, fmt.EntryMetaInfo(
            key, tokens, hashes, len(tokens) % self.page_size,
            tuple(tuple(x) for x in layout), state is not None, manifest[3]), msize,
            head_sum=fmt.head_digest(chunks[0]))
        if old is not None:
            self._gc(old.files)
        for p in new_pages:  # shorter tail files these continue are no longer needed
            self._supersede(p.hash)
        self._stats["puts"] += 1
        if self._bytes > self.max_bytes:
            log.warning("disk store: %d bytes over a budget of %d", self._bytes, self.max_bytes)
        return True

    @_locked
    def __contains__(self, key: str) -> bool:
        """Whether the store holds ``key`` (from the index: no file is read)."""
        return key in self._entries

    @_locked
    def get(self, key: str) -> StoredEntry | None:
        """The entry's metadata from the in-memory index (no file is read), or None. A file
        damaged since start-up is found when the entry is loaded (``load_entry``)."""
        e = self._entries.get(key)
        if e is None:
            return None
        return StoredEntry(key, tuple(e.tokens.tolist()), list(e.page_hashes), e.tail_tokens,
                           e.layout, e.has_state)

    @_locked
    def load_entry(self, key: str) -> LoadedEntry | None:
        """The entry's manifest read and verified, with its open tail pages and recurrent state;
        None when missing, corrupt or foreign (logged, the file removed)."""
        e = self._entries.get(key)
        if e is None:
            return None
        got = self._read_entry(e)
        if got is None:
            return None
        info, tensors = got
        e = self._entries[key]
        stored = StoredEntry(key, info.tokens, list(info.page_hashes), info.tail_tokens,
                             info.layout, info.has_state)
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

    def load_page(self, h: bytes) -> mx.array | None:
        """A page's data ``[layers, 2, kv_heads, page_size, head_dim]``, checksum verified; None
        when absent, truncated, corrupt or foreign (logged, the file removed)."""
        return self.load_pages([h])[h]

    @_locked
    def load_pages(self, hashes: Sequence[bytes]) -> dict[bytes, mx.array | None]:
        """Several pages at once, each as ``load_page`` gives it, read and verified in parallel
        straight into their MLX arrays (``page_reader``)."""
        todo = [h for h in dict.fromkeys(hashes) if h in self._pages
                and not self._info[h].partial]
        out: dict[bytes, mx.array | None] = {h: None for h in hashes}
        found = self._reader.read([(h, self._pages[h], self._info[h]) for h in todo])
        for h, (_, got), ok in zip(todo, found, self._settle(todo, found)):
            out[h] = got if ok else None
        return out

    @_locked
    def load_run(self, hashes: Sequence[bytes], group: int) -> tuple[mx.array | None, int]:
        """Consecutive full pages of ``group`` read into one array (``PageReader.read_run``):
        the array and how many of the pages, from the first, it holds verified (None, 0 when
        the first is not here)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._pages and not self._info[hashes[n]].partial \
                and self._info[hashes[n]].group == group:
            n += 1
        if n == 0:
            return None, 0
        todo = list(hashes[:n])
        arr, found = self._reader.read_run([(h, self._pages[h], self._info[h]) for h in todo],
                                           group)
        ok = self._settle(todo, found)
        return arr, (ok + [False]).index(False)

    def _settle(self, hashes: Sequence[bytes], found: Sequence[tuple[str, object]]) -> list[bool]:
        """Act on what the reader found (a bad file is logged and removed); per page, whether
        it was read."""
        out = []
        for h, (kind, got) in zip(hashes, found):
            if kind == "nodir":
                self._lost_page(h)
            elif kind != "ok":
                self._on_page_file(h, lambda fd, name, err=got: self._bad_file(err, fd, name,
                                                                                "page"))
            out.append(kind == "ok")
        return out

    def load_tail(self, key: str) -> mx.array | None:
        """Group 0's open tail page data ``[layers, 2, kv_heads, tail_tokens, head_dim]``;
        None when the entry has no tail or is missing, corrupt or foreign."""
        tails = self.load_tails(key)
        return None if tails is None else tails.get(0)

    def load_tails(self, key: str) -> dict[int, mx.array] | None:
        """Per group, the entry's open tail page data; None when the entry has no tail or is
        missing, corrupt or foreign."""
        got = self.load_entry(key)
        return None if got is None or not got.tails else got.tails

    def load_state(self, key: str) -> list[list[mx.array]] | None:
        """The recurrent state stored with the entry (per state slot, its arrays), or None."""
        got = self.load_entry(key)
        return None if got is None else got.state

    @_locked
    def delete(self, key: str) -> bool:
        """Remove ``key`` and the pages nothing else references. True if it was there."""
        if key not in self._entries:
            return False
        if not self._drop_entry(key):
            self._stats["errors"] += 1
            log.warning("disk store: could not delete an entry")
            return False
        return True

    @_locked
    def keys(self) -> list[str]:
        """Every entry's key, least recently used (put or touched) first."""
        return list(self._entries)

    @_locked
    def touch(self, key: str) -> None:
        """A hit: ``key`` becomes the most recently used (persisted as the manifest's mtime)."""
        e = self._entries.get(key)
        if e is None:
            return
        self._entries.move_to_end(key)
        self.policy.access(e.id)
        t = self._tick()
        try:
            os.utime(e.name, ns=(t, t), dir_fd=self._entries_fd, follow_symlinks=False)
        except (OSError, NotImplementedError) as err:
            log.debug("disk store: touch not persisted: %s", err)

    @_locked
    def stats(self) -> dict:
        s = self._stats
        tails = sum(1 for f in self._info.values() if f.partial)
        return {
            "entries": len(self._entries), "pages": len(self._pages) - tails, "tail_pages": tails,
            "bytes_on_disk": self._bytes, "budget": self.max_bytes, "policy": self.policy.name,
            **{k: s[k] for k in ("puts", "refused", "evictions", "corrupt_files_removed",
                                 "foreign_files_removed", "temp_files_removed", "errors")},
        }

    def close(self) -> None:
        """Release the root (and its lock). Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._reader.close()
                self._close_fds()

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- put helpers ----------------------------------------------------------------------------

    def _prepare(self, key, tokens, pages, tails=None, layout=None, state=None):
        """Validate a put; returns (tokens, new page and tail files, manifest, layout, stored
        files holding its tails) — manifest None: refused."""
        if not isinstance(key, str):
            raise ValueError("a key is a str")
        tokens = tuple(int(t) for t in tokens)
        if any(not fmt.INT64[0] <= t < fmt.INT64[1] for t in tokens):
            raise ValueError("token ids must fit int64")
        P, geo = self.page_size, self.geo
        sealed = [p for p in pages if p.hash is not None]
        rest = list(pages[len(sealed):])
        if len(rest) > 1 or any(p.hash is not None for p in rest):
            raise ValueError("pages are sealed full pages, then at most one open tail page")
        tails = dict(tails or {})
        if rest:
            if not 0 < len(rest[0].tokens) < P or rest[0].data is None:
                raise ValueError(f"the open tail page holds 1..{P - 1} tokens and its data")
            tails[0] = rest[0].data
        full, groups = len(tokens) // P, geo.spec.groups
        layout = [(0, len(sealed))] if layout is None else [tuple(x) for x in layout]
        if layout is not None and len(layout) != len(groups):
            raise ValueError(f"a layout per group: {len(groups)} wanted")
        if any(skip + count != full for skip, count in layout) \
                or sum(c for _, c in layout) != len(sealed):
            raise ValueError("the pages do not make up the entry's tokens")
        if (len(tokens) % P) and set(tails) != set(range(len(groups))) \
                or not (len(tokens) % P) and tails:
            raise ValueError("an open tail page per group when the tokens end inside a page")
        if (state is None) == geo.spec.has_state and tokens:
            raise ValueError("an entry of this model carries its recurrent state"
                             if geo.spec.has_state else "this model has no recurrent state")
        new_pages, new_set, hashes, at, parents = [], set(), [], 0, []
        for g, (skip, count) in enumerate(layout):
            chain = fmt.chain_hashes(geo.root(g), tokens, P)
            parents.append(chain[-1] if chain else geo.root(g))
            group_pages = sealed[at : at + count]
            at += count
            for i, p in enumerate(group_pages, start=skip):
                h = bytes(p.hash)
                if p.group != g or len(p.tokens) != P or chain[i] != h \
                        or tuple(p.tokens) != tokens[i * P : (i + 1) * P]:
                    raise ValueError("sealed pages must be full and their hashes chain over "
                                     "the tokens")
                hashes.append(h)
                if p.data is not None:
                    self._check_shape(p.data, P, g)
                    if h in self._pages and not self._page_file_exists(h):
                        self._lost_page(h)
                    if h not in self._pages and h not in new_set:
                        new_set.add(h)
                        parent = geo.root(g) if i == 0 else chain[i - 1]
                        chunks, data_sum = fmt.page_file(geo, h, parent, p.tokens, p.data, g)
                        new_pages.append(NewFile(h, chunks, fmt.nbytes(chunks), FileInfo(
                            parent, token_array(p.tokens), g, False, data_sum,
                            fmt.head_digest(chunks[0]))))
                elif h not in self._pages:
                    raise ValueError(f"page {h.hex()[:12]} is not on disk and came without data")
        n_tail, held = len(tokens) % P, set()
        tail = token_array(tokens[len(tokens) - n_tail:]) if n_tail else None
        for g, data in sorted(tails.items()):
            self._check_shape(data, n_tail, g)
            holder = self._holder(g, parents[g], tail)
            if holder is not None and not self._page_file_exists(holder):
                self._lost_page(holder)
                holder = self._holder(g, parents[g], tail)
            if holder is not None:
                held.add(holder)  # NOTE: a stored page or longer tail holds it: nothing written
                continue
            h = fmt.page_hash(parents[g], tail.tolist())
            chunks, data_sum = fmt.page_file(geo, h, parents[g], tail.tolist(), data, g)
            new_pages.append(NewFile(h, chunks, fmt.nbytes(chunks),
                                     FileInfo(parents[g], tail, g, True, data_sum,
                                              fmt.head_digest(chunks[0]))))
        try:
            chunks = fmt.entry_file(geo, key, tokens, hashes, layout, state)
        except FormatError as e:
            log.warning("disk store: entry refused: %s", e)
            self._stats["refused"] += 1
            return tokens, new_pages, None, layout, held
        return (tokens, new_pages, (chunks, hashes, fmt.nbytes(chunks),
                                    tuple(parents) if n_tail else ()), layout, held)

    def _check_shape(self, data: mx.array, n: int, group: int = 0) -> None:
        if list(data.shape) != self.geo.shape(n, group):
            raise ValueError(f"page data of shape {data.shape}; {self.geo.shape(n, group)} "
                             "expected")

    def _write_pages(self, new_pages: list[NewFile]) -> None:
        """Write new page and tail files as one batch (one full flush); index each as it
        lands."""
        fds: dict[tuple[bool, str], int] = {}
        try:
            for p in new_pages:
                d = (p.info.partial, p.hash.hex()[:2])
                if d not in fds:
                    fds[d] = afs.open_dir(d[1], self._tails_fd if d[0] else self._pages_fd,
                                          create=True)

            def landed(i: int, size: int) -> None:
                self._file_landed(new_pages[i].hash, size, new_pages[i].info)

            afs.atomic_write_many([(fds[(p.info.partial, p.hash.hex()[:2])],
                                    p.hash.hex() + ".safetensors", p.chunks, None)
                                   for p in new_pages], landed)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _read_entry(self, e: IndexedEntry):
        """(metadata, tensors) of a manifest, or None (a bad file is removed). A manifest whose
        header is byte for byte the one indexed is not parsed again: its metadata is the
        index's (its state tensors are still checked against their checksum)."""
        try:
            got = self._read(self._entries_fd, e.name, whole=True)
            tensors = fmt.decode_known_entry(self.geo, got, e.head_sum) \
                if len(got) == e.size else None
            if tensors is not None:
                return fmt.EntryMetaInfo(e.key, tuple(e.tokens.tolist()), list(e.page_hashes),
                                         e.tail_tokens, e.layout, e.has_state), tensors
            info, tensors = fmt.decode_entry(self.geo, got)
            if info.key != e.key:
                raise FormatError("the manifest is another key's")
        except (FormatError, OSError) as err:
            if not self._bad_file(err, self._entries_fd, e.name, "manifest"):
                return None
            self._forget_entry(e)
            self._gc(e.files)
            return None
        # replaced behind our back by another valid manifest of the key: indexed again
        self._forget_entry(e)
        self._add_entry(e.key, e.name, info, len(got),
                        head_sum=fmt.head_digest(got[: fmt.parse_header(got, len(got)).data_start]))
        self._gc(e.files)
        return info, tensors

    def _load_holder(self, h: bytes) -> mx.array | None:
        """The data of the page or tail file that holds an open tail page; None when it is
        missing or bad (logged, the file removed)."""
        f = self._info.get(h)
        if f is None:
            return None
        if not f.partial:
            return self.load_pages([h])[h]
        name = h.hex() + ".safetensors"
        try:
            sub_fd = afs.open_dir(name[:2], self._tails_fd, create=False)
        except OSError:
            self._lost_page(h)
            return None
        try:
            return fmt.decode_page(self.geo, self._read(sub_fd, name, whole=True), h,
                                   fmt.TAIL_FORMAT)
        except (FormatError, OSError) as err:
            if self._bad_file(err, sub_fd, name, "tail"):
                self._lost_page(h)
            return None
        finally:
            os.close(sub_fd)

    @staticmethod
    def _read(dir_fd: int, name: str, whole: bool):
        """The whole file (bytes) or its header only (``Header``), never through a link."""
        fd, size = afs.open_regular(name, dir_fd)
        try:
            return afs.read_all(fd, size) if whole else fmt.read_header(fd, size)
        finally:
            os.close(fd)

    def _take_lock(self) -> int | None:
        if fcntl is None:
            return None
        flags = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(".lock", os.O_RDWR | os.O_CREAT | flags, 0o600, dir_fd=self._root_fd)
        except OSError:
            try:
                fd = os.open(".lock", os.O_RDONLY | flags, dir_fd=self._root_fd)
            except OSError as e:
                log.warning("disk store: no lock file (%s); make sure one store uses %s", e,
                            self.root)
                return None
        self._fds.append(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DiskStoreLockedError(f"another disk store has {self.root} open") from None
        except OSError as e:
            log.warning("disk store: cannot lock %s (%s)", self.root, e)
        return fd

    def _close_fds(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
