"""The page pool: the one owner of every page's storage, ref count, seal and content hash.

A page belongs to one group of the model's cache spec (``kv_cache.model.spec``) and holds ``page_size``
token positions of keys and values for every layer of that group, stored as one MLX array shaped
``[group layers, 2, kv_heads, n, head_dim]`` (``n`` grows to ``page_size`` while the page is
open). Full pages are sealed: immutable, hashed with a chain over the model fingerprint and the
group (the chain's root), the parent page's hash and the page's token ids, and entered in the
prefix index, so every sequence that starts with the same tokens holds the same physical page.

Pages that nothing holds stay cached for reuse until the byte budget needs their room; an
eviction policy chooses among them, and only among leaf pages (no cached page continues them).
The pool grows on demand: storage exists only for pages that hold data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import mlx.core as mx

from kv_cache.pages.allocator import BlockAllocator
from kv_cache.errors import InvalidBlockError, OutOfBlocksError
from kv_cache.pages.eviction import EvictionPolicy, make_policy
from kv_cache.pages.hashing import chain_hashes, page_hash, root_hash
from kv_cache.pages.runs import PageRuns
from kv_cache.model.spec import CacheSpec, GroupSpec

Reclaimer = Callable[[int, int], None]  # (pages, group)


@dataclass(slots=True)
class PageMeta:
    ref_count: int = 0
    sealed: bool = False
    tokens: tuple[int, ...] = ()
    hash: bytes | None = None  # chained content hash, set when sealed
    parent: bytes | None = None  # hash of the page before it (the root hash for the first)
    indexed: bool = False  # entered in the prefix index (False only on a hash collision)
    group: int = 0  # the cache spec's group whose layers the page holds


@dataclass(slots=True)
class PoolStats:
    page_size: int
    page_bytes: int
    capacity_pages: int
    used_pages: int
    held_pages: int
    cached_pages: int  # resident, held by nothing, kept for reuse
    sealed_pages: int
    evictions: int = 0
    prefix_hits: int = 0
    used_bytes: int = 0
    extra: dict = field(default_factory=dict)


class PagePool:
    """Physical pages, their ref counts, seals and the prefix index, under a byte budget."""

    def __init__(
        self,
        num_layers: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        page_size: int = 32,
        dtype: mx.Dtype = mx.float16,
        max_bytes: int = 2 << 30,
        policy: str | EvictionPolicy = "lru",
        fingerprint: str = "",
        spec: CacheSpec | None = None,
    ):
        """Pages for the paged groups of ``spec``, or, without one, for a model whose
        ``num_layers`` layers are all full attention of one shape in ``dtype``."""
        if spec is None:
            if any(x is None for x in (num_layers, num_kv_heads, head_dim)) \
                    or min(num_layers, num_kv_heads, head_dim, page_size) <= 0:
                raise ValueError("layers, heads, head_dim and page_size must all be > 0")
            spec = CacheSpec.plain(num_layers, num_kv_heads, head_dim, dtype)
        if page_size <= 0:
            raise ValueError("page_size must be > 0")
        self.spec = spec
        self.groups: tuple[GroupSpec, ...] = spec.groups
        g0 = self.groups[0] if self.groups else None
        # Group 0's layout, for single-group callers and reports.
        self.num_layers = len(g0.layers) if g0 else 0
        self.num_kv_heads = g0.num_kv_heads if g0 else 0
        self.head_dim = g0.head_dim if g0 else 0
        self.dtype = g0.mx_dtype if g0 else dtype
        self.page_size = page_size
        self.group_page_bytes = [g.page_bytes(page_size) for g in self.groups]
        self.page_bytes = self.group_page_bytes[0] if self.groups else 0
        self.max_bytes = max_bytes
        smallest = min(self.group_page_bytes, default=0)
        self.allocator = BlockAllocator(max_bytes // smallest if smallest else 0)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.fingerprint = fingerprint
        self.roots = [root_hash(fingerprint, g) for g in range(len(self.groups))]
        self.root = root_hash(fingerprint)
        self.reclaimer: Reclaimer | None = None  # asked to drop holds when pages run short
        self._meta: dict[int, PageMeta] = {}
        self._data: dict[int, mx.array] = {}
        self._runs = PageRuns(page_size)  # pages restored together into one array
        self._index: dict[bytes, int] = {}  # hash -> sealed block
        self._children: dict[bytes, int] = {}  # hash -> number of indexed pages continuing it
        self._num_cached = 0  # indexed pages with ref_count 0
        self._cached_bytes = 0
        self._used_bytes = 0
        self._evictions = 0
        self._prefix_hits = 0

    # -- capacity -------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.allocator.num_blocks

    def block_bytes(self, block: int) -> int:
        return self.group_page_bytes[self._get(block).group]

    def can_allocate(self, n: int, group: int = 0) -> bool:
        """Whether ``n`` pages of ``group`` can be had without dropping any holder (evicting
        cached pages)."""
        if n == 0:
            return True
        free_bytes = self.max_bytes - self._used_bytes + self._cached_bytes
        return (n * self.group_page_bytes[group] <= free_bytes
                and n <= self.allocator.num_free + self._num_cached)

    def allocate(self, n: int, group: int = 0) -> list[int]:
        """``n`` new open pages of ``group``, each held once by the caller: all or none.

        Evicts cached pages as needed; when that is not enough, asks the reclaimer (once) to
        drop holds, then raises ``OutOfBlocksError``.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if not self.can_allocate(n, group) and self.reclaimer is not None:
            self.reclaimer(n, group)
        if not self.can_allocate(n, group):
            raise OutOfBlocksError(
                f"need {n} pages; {self.allocator.num_free} free and {self._num_cached} cached "
                f"of {self.capacity} ({self.group_page_bytes[group]} bytes each)"
            )
        need = n * self.group_page_bytes[group]
        while self.allocator.num_free < n or self._used_bytes + need > self.max_bytes:
            victim = self.policy.victim(self._can_evict)
            if victim is None:
                # NOTE: cached pages that held pages continue (a sliding window releases the
                # pages behind it, not the ones after) are not leaves, so not evictable yet.
                raise OutOfBlocksError(f"need {n} pages; the cached ones left are continued "
                                       "by pages in use")
            self._evict(victim)
        blocks = self.allocator.alloc_n(n)
        for b in blocks:
            self._meta[b] = PageMeta(ref_count=1, group=group)
        self._used_bytes += need
        return blocks

    # -- holders --------------------------------------------------------------------------------

    def hold(self, block: int) -> None:
        """One more holder of ``block`` (a sequence, a stored entry)."""
        self.hold_all((block,))

    def hold_all(self, blocks: Iterable[int | None]) -> None:
        """``hold`` each of ``blocks`` (None: a page a table does not hold, skipped). One pass:
        a long chat holds hundreds of pages at once."""
        access, sizes = self.policy.access, self.group_page_bytes
        for block in blocks:
            if block is None:
                continue
            meta = self._get(block)
            if meta.ref_count == 0:
                self._num_cached -= 1
                self._cached_bytes -= sizes[meta.group]
            meta.ref_count += 1
            if meta.indexed:
                access(block)

    def release(self, block: int) -> None:
        """One holder fewer; at zero a sealed page stays cached, an open page is freed."""
        self.release_all((block,))

    def release_all(self, blocks: Iterable[int | None]) -> None:
        """``release`` each of ``blocks`` (None skipped), in one pass."""
        sizes = self.group_page_bytes
        for block in blocks:
            if block is None:
                continue
            meta = self._get(block)
            assert meta.ref_count > 0, f"release of block {block}, which nothing holds"
            meta.ref_count -= 1
            if meta.ref_count == 0:
                if meta.indexed:
                    self._num_cached += 1
                    self._cached_bytes += sizes[meta.group]
                else:
                    self._free(block)

    def ref_count(self, block: int) -> int:
        return self._get(block).ref_count

    # -- content --------------------------------------------------------------------------------

    def num_tokens(self, block: int) -> int:
        return len(self._get(block).tokens)

    def tokens(self, block: int) -> tuple[int, ...]:
        return self._get(block).tokens

    def is_sealed(self, block: int) -> bool:
        return self._get(block).sealed

    def all_sealed(self, blocks: Sequence[int | None]) -> bool:
        """Whether every one of ``blocks`` is a sealed page (None: no page, so not)."""
        metas = self._meta
        for block in blocks:
            meta = metas.get(block) if block is not None else None
            if meta is None or not meta.sealed:
                return False
        return True

    def hash_of(self, block: int) -> bytes | None:
        return self._get(block).hash

    def group_of(self, block: int) -> int:
        return self._get(block).group

    def data(self, block: int) -> mx.array:
        """The page's storage, ``[group layers, 2, kv_heads, n, head_dim]``. Read only."""
        self._get(block)
        return self._page_data(block)

    def _page_data(self, block: int) -> mx.array:
        d = self._data.get(block)
        return self._runs.page(block) if d is None else d

    def is_writable(self, block: int, at: int) -> bool:
        """Whether the caller may append at position ``at`` of ``block`` in place: the page is
        open, held by the caller alone, and holds exactly ``at`` tokens."""
        meta = self._get(block)
        return not meta.sealed and meta.ref_count == 1 and len(meta.tokens) == at

    def write(self, block: int, kv: mx.array, tokens: Sequence[int]) -> None:
        """Append ``kv`` (``[group layers, 2, kv_heads, n, head_dim]``) for ``tokens`` to an open
        page."""
        meta = self._get(block)
        # NOTE: docs/ARCHITECTURE.md, invariant 1: a sealed page never changes; a shared page is copied before a write.
        assert not meta.sealed, f"write to sealed block {block}"
        assert meta.ref_count == 1, f"write to block {block} held {meta.ref_count} times"
        n, group = len(tokens), self.groups[meta.group]
        if kv.shape != group.shape(n):
            raise ValueError(f"page data of shape {kv.shape} does not fit this pool")
        if len(meta.tokens) + n > self.page_size:
            raise ValueError(f"block {block} has room for {self.page_size - len(meta.tokens)}")
        kv = kv.astype(group.mx_dtype)
        old = self._data.get(block)
        self._data[block] = kv if old is None else mx.concatenate([old, kv], axis=3)
        meta.tokens = meta.tokens + tuple(map(int, tokens))

    def copy(self, block: int, n_tokens: int | None = None) -> int:
        """A new open page holding the first ``n_tokens`` tokens of ``block`` (copy-on-write)."""
        meta = self._get(block)
        n = len(meta.tokens) if n_tokens is None else n_tokens
        if not 0 < n <= len(meta.tokens):
            raise ValueError(f"cannot copy {n} tokens of block {block} ({len(meta.tokens)} held)")
        self.hold(block)  # keep the source alive if allocation evicts
        try:
            (new,) = self.allocate(1, meta.group)
        finally:
            self.release(block)
        self._data[new] = mx.contiguous(self._page_data(block)[:, :, :, :n, :])
        self._meta[new].tokens = meta.tokens[:n]
        return new

    def seal(self, block: int, parent: bytes, h: bytes | None = None) -> int:
        """Seal a full open page under the chain ``parent``; returns the block now holding it.
        ``h``: the page's hash where the caller has it already (``page_hash(parent, tokens)``).

        If an identical page (same hash and tokens) is already indexed, the caller's hold moves
        to that page and ``block`` is freed: pages are stored once.
        """
        meta = self._get(block)
        assert not meta.sealed, f"block {block} is sealed already"
        assert meta.ref_count == 1, f"seal of block {block} held {meta.ref_count} times"
        if len(meta.tokens) != self.page_size:
            raise ValueError(f"only full pages are sealed; block {block} has {len(meta.tokens)}")
        h = page_hash(parent, meta.tokens) if h is None else h
        existing = self._index.get(h)
        if existing is not None and self._meta[existing].tokens == meta.tokens:
            self.hold(existing)
            self.release(block)
            return existing
        meta.sealed, meta.hash, meta.parent = True, h, parent
        if existing is None:
            self._enter(block, meta)
        return block

    def _enter(self, block: int, meta: PageMeta) -> None:
        """Enter a sealed page (its hash and parent set) in the prefix index and the policy."""
        meta.indexed = True
        self._index[meta.hash] = block
        self._children[meta.parent] = self._children.get(meta.parent, 0) + 1
        self.policy.insert(block, ident=meta.hash)

    def add_sealed(self, parent: bytes, tokens: Sequence[int], kv: mx.array,
                   group: int = 0, h: bytes | None = None) -> int:
        """A sealed page of ``group`` built from outside data (a disk store); held once by the
        caller. ``h``: its hash where the caller has it (``page_hash(parent, tokens)``)."""
        h = page_hash(parent, tokens) if h is None else h
        existing = self._index.get(h)
        if existing is not None and self._meta[existing].tokens == tuple(tokens):
            self.hold(existing)
            return existing
        (block,) = self.allocate(1, group)
        self.write(block, kv, tokens)
        return self.seal(block, parent, h)

    def add_sealed_run(self, parent: bytes, pages: Sequence[tuple[bytes, Sequence[int]]],
                       array: mx.array, group: int = 0) -> list[int]:
        """Consecutive sealed pages of ``group`` (``(hash, tokens)`` each, the first continuing
        ``parent``) whose data is ``array`` ``[layers, 2, kv_heads, len(pages) * page_size,
        head_dim]``, one slice a page (``kv_cache.pages.runs``): cached, held by nobody. None of
        them may be in the pool already. All or none (``OutOfBlocksError``)."""
        assert all(self._index.get(h) is None for h, _ in pages), "a page of the run is cached"
        if any(len(tokens) != self.page_size for _, tokens in pages):
            raise ValueError("only full pages are sealed, and a run holds only sealed pages")
        blocks = self.allocate(len(pages), group)
        # NOTE: ``seal`` and ``release`` for each page, in one pass: a restore of a long chat
        # of a small model adds hundreds of pages, and this is per-page interpreter work.
        for b, (h, tokens) in zip(blocks, pages):
            meta = self._meta[b]
            meta.tokens = tuple(map(int, tokens))
            meta.sealed, meta.hash, meta.parent, meta.ref_count = True, h, parent, 0
            self._enter(b, meta)
            parent = h
        self._runs.add(array, blocks)
        self._num_cached += len(blocks)
        self._cached_bytes += len(blocks) * self.group_page_bytes[group]
        return blocks

    def run_array(self, blocks: Sequence[int], num_tokens: int) -> mx.array | None:
        """The one array holding exactly ``blocks`` (a run restored together), when
        ``num_tokens`` fills them; else None."""
        return self._runs.whole(blocks, num_tokens)

    def _pieces(self, blocks: Sequence[int], num_tokens: int) -> list[mx.array]:
        P = self.page_size
        if not (len(blocks) - 1) * P < num_tokens <= len(blocks) * P:
            raise ValueError(f"{num_tokens} tokens do not match {len(blocks)} pages")
        pieces = []
        for i, b in enumerate(blocks):
            n = min(P, num_tokens - i * P)
            if self.num_tokens(b) < n:
                raise ValueError(f"block {b} holds {self.num_tokens(b)} tokens, {n} needed")
            d = self._page_data(b)
            pieces.append(d if d.shape[3] == n else d[:, :, :, :n, :])
        return pieces

    def gather(self, blocks: Sequence[int], num_tokens: int) -> mx.array:
        """The first ``num_tokens`` positions held by ``blocks``, as one array
        ``[layers, 2, kv_heads, num_tokens, head_dim]``."""
        pieces = self._pieces(blocks, num_tokens)
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=3)

    def gather_layers(self, blocks: Sequence[int], num_tokens: int,
                      room: int = 0) -> list[tuple[mx.array, mx.array]]:
        """Per layer, keys and values ``[1, kv_heads, num_tokens + room, head_dim]`` holding the
        first ``num_tokens`` positions, then ``room`` zero positions to write into: one copy of
        the data, straight into each layer's own buffer. Without room, the copy is one array
        for all layers and each layer's keys and values are contiguous slices of it (one
        operation however many pages and layers: a prefix view's read-only data)."""
        pieces = self._pieces(blocks, num_tokens)
        if not room:
            every = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=3)
            return [(every[layer, 0][None], every[layer, 1][None])
                    for layer in range(every.shape[0])]
        g = self.groups[self._get(blocks[0]).group]
        pad = [mx.zeros((g.num_kv_heads, room, g.head_dim), g.mx_dtype)]
        out = []
        for layer in range(len(g.layers)):
            k = mx.concatenate([p[layer, 0] for p in pieces] + pad, axis=1)
            v = mx.concatenate([p[layer, 1] for p in pieces] + pad, axis=1)
            out.append((k[None], v[None]))
        return out

    # -- prefix index ---------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], group: int = 0) -> list[int]:
        """The indexed full pages of ``group`` that hold the longest page-aligned prefix of
        ``tokens``.

        Returns block ids without holding them; the caller holds what it keeps.
        """
        P, parent, blocks = self.page_size, self.roots[group], []
        for i in range(len(tokens) // P):
            chunk = tuple(int(t) for t in tokens[i * P : (i + 1) * P])
            h = page_hash(parent, chunk)
            b = self._index.get(h)
            if b is None or self._meta[b].tokens != chunk:
                break
            blocks.append(b)
            parent = h
        self._prefix_hits += len(blocks)
        return blocks

    def lookup(self, h: bytes) -> int | None:
        """The indexed block holding the sealed page with chain hash ``h`` (not held)."""
        return self._index.get(h)

    def match_hashes(self, hashes: Sequence[bytes], tokens: Sequence[int]) -> list[int | None]:
        """For each chain hash of ``hashes`` (pages of ``tokens``), the indexed block holding it
        with the same tokens, or None. Not held."""
        P, out = self.page_size, []
        for i, h in enumerate(hashes):
            b = self._index.get(h)
            ok = b is not None and self._meta[b].tokens == tuple(tokens[i * P : (i + 1) * P])
            out.append(b if ok else None)
        return out

    def chain(self, tokens: Sequence[int], group: int = 0) -> list[bytes]:
        """The chain hashes of every full page of ``tokens`` in ``group``."""
        return chain_hashes(self.roots[group], tokens, self.page_size)

    def parent_hash(self, blocks: Sequence[int], index: int) -> bytes:
        """The chain hash that the ``index``-th page of ``blocks`` (one group's) continues."""
        if index == 0:
            return self.roots[self._get(blocks[0]).group]
        h = self._get(blocks[index - 1]).hash
        assert h is not None, f"page {index - 1} of a sequence is not sealed"
        return h

    # -- eviction -------------------------------------------------------------------------------

    def _can_evict(self, block: int) -> bool:
        meta = self._meta.get(block)
        return (
            meta is not None
            and meta.ref_count == 0
            and meta.indexed
            and self._children.get(meta.hash, 0) == 0
        )

    def _evict(self, block: int) -> None:
        meta = self._meta[block]
        assert self._can_evict(block), f"evicting block {block}, which is held or not a leaf"
        self._num_cached -= 1
        self._cached_bytes -= self.group_page_bytes[meta.group]
        self._evictions += 1
        self._free(block, from_policy=True)

    def evict_all_cached(self) -> int:
        """Drop every cached page that nothing holds; returns how many went."""
        n = 0
        while (victim := self.policy.victim(self._can_evict)) is not None:
            self._evict(victim)
            n += 1
        return n

    def _free(self, block: int, from_policy: bool = False) -> None:
        meta = self._meta.pop(block)
        if meta.indexed:
            del self._index[meta.hash]
            left = self._children[meta.parent] - 1
            if left:
                self._children[meta.parent] = left
            else:
                del self._children[meta.parent]
            if not from_policy:
                self.policy.remove(block)
        self._data.pop(block, None)
        for b in self._runs.free(block):  # a run's storage goes with its last page
            self._used_bytes -= self.group_page_bytes[meta.group]
            self.allocator.free(b)

    # -- reports --------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        held = sum(1 for m in self._meta.values() if m.ref_count > 0)
        return PoolStats(
            page_size=self.page_size,
            page_bytes=self.page_bytes,
            capacity_pages=self.capacity,
            used_pages=len(self._meta),
            held_pages=held,
            cached_pages=self._num_cached,
            sealed_pages=sum(1 for m in self._meta.values() if m.sealed),
            evictions=self._evictions,
            prefix_hits=self._prefix_hits,
            used_bytes=self._used_bytes,
        )

    def ref_counts(self) -> dict[int, int]:
        """Every resident page's ref count (for checks and reports)."""
        return {b: m.ref_count for b, m in self._meta.items()}

    def _get(self, block: int) -> PageMeta:
        meta = self._meta.get(block)
        if meta is None:
            raise InvalidBlockError(f"block {block!r} is not allocated")
        return meta
