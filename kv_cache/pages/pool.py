"""The page pool: the one owner of every page, its ref count (invariant 2) and its place in the
byte budget.

A page belongs to one group of the model's cache spec (``kv_cache.layout.spec``) and holds
``page_size`` token positions of keys and values for every layer of that group. The pool holds
its parts and keeps their books together: ``storage.py`` keeps the pages' data, ``budget.py``
what they take of the byte budget, ``prefix_index.py`` finds sealed pages by content,
``holders.py`` counts each page's holds by kind of holder, ``allocator.py`` hands out page ids,
``eviction.py`` chooses which cached page goes. The ref counts are the one registry of who holds
what.

A full page is sealed once: immutable from then on, hashed with a chain over the model
fingerprint and the group (the chain's root), the parent page's hash and the page's token ids,
and entered in the prefix index, so every sequence that starts with the same tokens holds the
same physical page. Pages read from outside (a disk store) come in sealed.

Pages that nothing holds stay cached for reuse until the byte budget needs their room; an
eviction policy chooses among them, and only among leaf pages (no cached page continues them).
The pool grows on demand: storage exists only for pages that hold data. When evicting cached pages
is not enough, ``allocate`` raises ``OutOfBlocksError`` saying what it needed: the caller makes
room (``CacheManager.make_room`` drops holders) and tries again. The pool never calls up.

An observer (``events``, ``kv_cache.pages.events``) is told of each page entered in the prefix index
(stored) and each indexed page freed (removed), as ``MEDIUM_RAM``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import mlx.core as mx

from kv_cache.pages.allocator import BlockAllocator
from kv_cache.errors import InvalidBlockError, OutOfBlocksError
from kv_cache.pages.events import MEDIUM_RAM, CacheEvents, StoredPage
from kv_cache.pages.budget import Budget
from kv_cache.pages.eviction import EvictionPolicy, make_policy
from kv_cache.pages.hashing import page_hash, root_hash
from kv_cache.pages.holders import SEQUENCE, Holders
from kv_cache.pages.meta import PageMeta
from kv_cache.pages.prefix_index import PrefixIndex
from kv_cache.pages.storage import PageStorage
from kv_cache.layout.spec import CacheSpec, GroupSpec
from kv_cache.pages.spans import Extra, Span


@dataclass(frozen=True, slots=True)
class PoolStats:
    """What the pool holds at one moment (the server's ``ram`` figures are read from it)."""

    page_size: int
    page_bytes: int
    capacity_pages: int
    used_pages: int
    held_pages: int
    cached_pages: int  # resident, held by nothing, kept for reuse
    sealed_pages: int
    evictions: int  # pages evicted since the pool was made
    prefix_hits: int  # pages found by the prefix index (``match_prefix``)
    used_bytes: int
    shared_bytes: int  # pages held more than once
    budget_bytes: int


class PagePool:
    """Physical pages, their ref counts (by kind of holder: ``holders``), seals and the prefix
    index, under a byte budget."""

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
        smallest = min(self.group_page_bytes, default=0)
        self.allocator = BlockAllocator(max_bytes // smallest if smallest else 0)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.fingerprint = fingerprint
        self.roots = [root_hash(fingerprint, g) for g in range(len(self.groups))]
        self.root = root_hash(fingerprint)
        self._meta: dict[int, PageMeta] = {}
        self.storage = PageStorage(page_size)  # the pages' data
        self.budget = Budget(max_bytes, self.group_page_bytes)
        self.index = PrefixIndex(page_size, self.roots, self._meta)
        self.holders = Holders()  # the ref counts by kind of holder
        self.events: CacheEvents | None = None  # told of pages indexed and freed

    # -- capacity -------------------------------------------------------------------------------

    @property
    def max_bytes(self) -> int:
        return self.budget.max_bytes

    @property
    def capacity(self) -> int:
        return self.allocator.num_blocks

    def block_bytes(self, block: int) -> int:
        return self.group_page_bytes[self._get(block).group]

    def can_allocate(self, n: int, group: int = 0) -> bool:
        """Whether ``n`` pages of ``group`` can be had without dropping any holder (evicting
        cached pages)."""
        return n == 0 or self.budget.fits(n, group, self.allocator.num_free)

    def allocate(self, n: int, group: int = 0) -> list[int]:
        """``n`` new open pages of ``group``, each held once by the caller (a sequence): all or
        none. Evicts cached pages as needed; when that is not enough, raises
        ``OutOfBlocksError`` with ``pages=n, group=group`` and changes nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if not self.can_allocate(n, group):
            raise OutOfBlocksError(
                f"need {n} pages; {self.allocator.num_free} free and {self.budget.cached_pages} "
                f"cached of {self.capacity} ({self.group_page_bytes[group]} bytes each)", n, group)
        while self.allocator.num_free < n or self.budget.over(n, group):
            victim = self.policy.victim(self._can_evict)
            if victim is None:
                # NOTE: cached pages that held pages continue (a sliding window releases the
                # pages behind it, not the ones after) are not leaves, so not evictable yet.
                raise OutOfBlocksError(f"need {n} pages; the cached ones left are continued "
                                       "by pages in use", n, group)
            self._evict(victim)
        blocks = self.allocator.alloc_n(n)
        held = self.holders.counts(SEQUENCE)
        for b in blocks:
            self._meta[b] = PageMeta(ref_count=1, group=group)
            held[b] = 1
        self.budget.use(n, group)
        return blocks

    # -- holders --------------------------------------------------------------------------------

    def hold(self, block: int, by: str = SEQUENCE) -> None:
        """One more holder of ``block``, of kind ``by`` (``kv_cache.pages.holders``)."""
        self.hold_all((block,), by)

    def hold_all(self, blocks: Iterable[int | None], by: str = SEQUENCE) -> None:
        """``hold`` each of ``blocks`` (None: a page a table does not hold, skipped). One pass:
        a long chat holds hundreds of pages at once."""
        access, budget, held = self.policy.access, self.budget, self.holders.counts(by)
        for block in blocks:
            if block is None:
                continue
            meta = self._get(block)
            if meta.ref_count == 0:
                budget.uncache(meta.group)
            meta.ref_count += 1
            held[block] = held.get(block, 0) + 1
            if meta.indexed:
                access(block)

    def release(self, block: int, by: str = SEQUENCE) -> None:
        """One holder (of kind ``by``) fewer; at zero a sealed page stays cached, an open page
        is freed."""
        self.release_all((block,), by)

    def release_all(self, blocks: Iterable[int | None], by: str = SEQUENCE) -> None:
        """``release`` each of ``blocks`` (None skipped), in one pass."""
        budget, held = self.budget, self.holders.counts(by)
        for block in blocks:
            if block is None:
                continue
            meta = self._get(block)
            n = held.get(block, 0)
            # NOTE: docs/ARCHITECTURE.md, invariant 2: ref_count = holders, counted by kind.
            assert n > 0, (f"release of block {block}, which nothing holds" if not meta.ref_count
                           else f"release of block {block} by a {by}, which does not hold it")
            if n == 1:
                del held[block]
            else:
                held[block] = n - 1
            meta.ref_count -= 1
            if meta.ref_count == 0:
                if meta.indexed:
                    budget.cache(meta.group)
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
        return self.storage.page(block)

    def is_writable(self, block: int, at: int) -> bool:
        """Whether the caller may append at position ``at`` of ``block`` in place: the page is
        open, held by the caller alone, and holds exactly ``at`` tokens."""
        meta = self._get(block)
        return not meta.sealed and meta.ref_count == 1 and len(meta.tokens) == at

    def write(self, block: int, kv: mx.array, tokens: Sequence[int]) -> None:
        """Append ``kv`` for ``tokens`` to an open page, as stored (``GroupSpec.encode``:
        ``[group layers, 2, kv_heads, n, head_dim]`` values, or their codes in bits)."""
        meta = self._get(block)
        # NOTE: docs/ARCHITECTURE.md, invariant 1: a sealed page never changes; a shared page
        # is copied before a write.
        assert not meta.sealed, f"write to sealed block {block}"
        assert meta.ref_count == 1, f"write to block {block} held {meta.ref_count} times"
        n, group = len(tokens), self.groups[meta.group]
        if kv.shape != group.stored_shape(n):
            raise ValueError(f"page data of shape {kv.shape} does not fit this pool")
        if len(meta.tokens) + n > self.page_size:
            raise ValueError(f"block {block} has room for {self.page_size - len(meta.tokens)}")
        self.storage.append(block, kv.astype(getattr(mx, group.stored_dtype)))
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
        self.storage.copy(block, new, n)
        self._meta[new].tokens = meta.tokens[:n]
        return new

    def run_array(self, blocks: Sequence[int], num_tokens: int) -> mx.array | None:
        """The one array of values holding exactly ``blocks`` (a run restored together), when
        ``num_tokens`` fills them; else None (also for pages in bits: their values are a
        decoded copy, ``gather_layers``)."""
        if blocks and self.groups[self._get(blocks[0]).group].quant is not None:
            return None
        return self.storage.run_array(blocks, num_tokens)

    def gather(self, blocks: Sequence[int], num_tokens: int) -> mx.array:
        """The first ``num_tokens`` positions held by ``blocks``, as one array
        ``[layers, 2, kv_heads, num_tokens, head_dim]``."""
        return self.storage.gather(blocks, num_tokens)

    def gather_layers(self, blocks: Sequence[int], num_tokens: int,
                      room: int = 0) -> list[tuple[mx.array, mx.array]]:
        """Per layer, keys and values ``[1, kv_heads, num_tokens + room, head_dim]``: the first
        ``num_tokens`` positions, then ``room`` zero positions (``PageStorage.gather_layers``);
        values, decoded from pages in bits."""
        group = self.groups[self._get(blocks[0]).group] if blocks else None
        return self.storage.gather_layers(blocks, num_tokens, room, group)

    # -- sealing --------------------------------------------------------------------------------

    def seal(self, block: int, parent: bytes, h: bytes | None = None,
             extras: Sequence[Extra] = ()) -> int:
        """Seal a full open page under the chain ``parent``; returns the block now holding it.
        ``h``: the page's hash where the caller has it already (``page_hash(parent, tokens)``;
        a page that holds an image's tokens must be given it, with its extra keys ``extras``).

        If an identical page (same hash and tokens) is already indexed, the caller's hold moves
        to that page and ``block`` is freed: pages are stored once.
        """
        meta = self._get(block)
        assert not meta.sealed, f"block {block} is sealed already"
        assert meta.ref_count == 1, f"seal of block {block} held {meta.ref_count} times"
        if len(meta.tokens) != self.page_size:
            raise ValueError(f"only full pages are sealed; block {block} has {len(meta.tokens)}")
        h = page_hash(parent, meta.tokens) if h is None else h
        existing = self.index.find(h, meta.tokens)
        if existing is not None:
            self.hold(existing)
            self.release(block)
            return existing
        meta.sealed, meta.hash, meta.parent, meta.extras = True, h, parent, tuple(extras)
        if self.index.lookup(h) is None:  # else a collision: sealed, not indexed
            self._enter(block, meta)
            if self.events is not None:
                self.events.stored(MEDIUM_RAM, [self._stored(meta)])
        return block

    def _enter(self, block: int, meta: PageMeta) -> None:
        """Enter a sealed page (its hash and parent set) in the prefix index and the policy."""
        self.index.enter(block, meta)
        self.policy.insert(block, ident=meta.hash)

    def add_sealed(self, parent: bytes, tokens: Sequence[int], kv: mx.array,
                   group: int = 0, h: bytes | None = None, extras: Sequence[Extra] = ()) -> int:
        """A sealed page of ``group`` built from outside data (a disk store); held once by the
        caller. ``h``: its hash where the caller has it (``page_hash(parent, tokens)``; a page
        that holds an image's tokens must be given it, with its extra keys ``extras``)."""
        h = page_hash(parent, tokens) if h is None else h
        existing = self.index.find(h, tuple(tokens))
        if existing is not None:
            self.hold(existing)
            return existing
        (block,) = self.allocate(1, group)
        self.write(block, kv, tokens)
        return self.seal(block, parent, h, extras)

    def add_sealed_run(self, parent: bytes, pages: Sequence[tuple[bytes, Sequence[int]]],
                       array: mx.array, group: int = 0,
                   extras: Sequence[Sequence[Extra]] = ()) -> list[int]:
        """Consecutive sealed pages of ``group`` (``(hash, tokens)`` each, the first continuing
        ``parent``; ``extras``: each one's image keys, where any) whose data is ``array``
        ``[layers, 2, kv_heads, len(pages) * page_size, head_dim]``, one slice a page
        (``kv_cache.pages.runs``): cached, held by nobody. None of them may be in the pool
        already. All or none (``OutOfBlocksError``)."""
        assert all(self.index.lookup(h) is None for h, _ in pages), "a page of the run is cached"
        if any(len(tokens) != self.page_size for _, tokens in pages):
            raise ValueError("only full pages are sealed, and a run holds only sealed pages")
        blocks = self.allocate(len(pages), group)
        # NOTE: ``seal`` and ``release`` for each page, in one pass: a restore of a long chat
        # of a small model adds hundreds of pages, and this is per-page interpreter work.
        for i, (b, (h, tokens)) in enumerate(zip(blocks, pages)):
            meta = self._meta[b]
            meta.tokens = tuple(map(int, tokens))
            meta.sealed, meta.hash, meta.parent, meta.ref_count = True, h, parent, 0
            if i < len(extras):
                meta.extras = tuple(extras[i])
            self._enter(b, meta)
            parent = h
        self.storage.add_run(array, blocks)
        self.budget.cache(group, len(blocks))
        if self.events is not None:
            self.events.stored(MEDIUM_RAM, [self._stored(self._meta[b]) for b in blocks])
        return blocks

    # -- finding pages by content (the prefix index's) ------------------------------------------

    def match_prefix(self, tokens: Sequence[int], group: int = 0,
                     spans: Sequence[Span] = ()) -> list[int]:
        """The indexed full pages of ``group`` that hold the longest page-aligned prefix of
        ``tokens`` (with image ``spans``). Not held: the caller holds what it keeps."""
        return self.index.match_prefix(tokens, group, spans)

    def lookup(self, h: bytes) -> int | None:
        """The indexed block holding the sealed page with chain hash ``h`` (not held)."""
        return self.index.lookup(h)

    def match_hashes(self, hashes: Sequence[bytes], tokens: Sequence[int]) -> list[int | None]:
        """For each chain hash of ``hashes`` (pages of ``tokens``), the indexed block holding it
        with the same tokens, or None. Not held."""
        return self.index.match_hashes(hashes, tokens)

    def chain(self, tokens: Sequence[int], group: int = 0,
              spans: Sequence[Span] = ()) -> list[bytes]:
        """The chain hashes of every full page of ``tokens`` (with image ``spans``) in
        ``group``."""
        return self.index.chain(tokens, group, spans)

    # -- eviction -------------------------------------------------------------------------------

    def _can_evict(self, block: int) -> bool:
        meta = self._meta.get(block)
        return (
            meta is not None
            and meta.ref_count == 0
            and meta.indexed
            and self.index.is_leaf(meta)
        )

    def _evict(self, block: int) -> None:
        meta = self._meta[block]
        assert self._can_evict(block), f"evicting block {block}, which is held or not a leaf"
        self.budget.evicted(meta.group)
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
            self.index.remove(meta)
            if not from_policy:
                self.policy.remove(block)
            if self.events is not None:
                self.events.removed(MEDIUM_RAM, [meta.hash])
        for b in self.storage.free(block):  # a run's storage goes with its last page
            self.budget.give_back(meta.group)
            self.allocator.free(b)

    # -- what an observer is told (``events``) --------------------------------------------------

    def _stored(self, meta: PageMeta) -> StoredPage:
        parent = None if meta.parent == self.roots[meta.group] else meta.parent
        return StoredPage(meta.hash, parent, meta.tokens, meta.extras, meta.group)

    def stored_pages(self) -> list[StoredPage]:
        """Every page in the prefix index, as ``events`` is told of one."""
        return [self._stored(m) for m in self._meta.values() if m.indexed]

    # -- reports --------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        metas, sizes, budget = self._meta.values(), self.group_page_bytes, self.budget
        return PoolStats(
            page_size=self.page_size,
            page_bytes=self.page_bytes,
            capacity_pages=self.capacity,
            used_pages=len(self._meta),
            held_pages=sum(1 for m in metas if m.ref_count > 0),
            cached_pages=budget.cached_pages,
            sealed_pages=sum(1 for m in metas if m.sealed),
            evictions=budget.evictions,
            prefix_hits=self.index.hits,
            used_bytes=budget.used_bytes,
            shared_bytes=sum(sizes[m.group] for m in metas if m.ref_count > 1),
            budget_bytes=budget.max_bytes,
        )

    def ref_counts(self) -> dict[int, int]:
        """Every resident page's ref count (for checks and reports)."""
        return {b: m.ref_count for b, m in self._meta.items()}

    def _get(self, block: int) -> PageMeta:
        meta = self._meta.get(block)
        if meta is None:
            raise InvalidBlockError(f"block {block!r} is not allocated")
        return meta
