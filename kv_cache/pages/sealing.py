"""Sealing pages and finding them by content: a part of ``PagePool`` (``pool.py``).

A full page is sealed once: immutable from then on, hashed with a chain over the model
fingerprint and the group (the chain's root), the parent page's hash and the page's token ids,
and entered in the prefix index (``prefix_index.py``), so every sequence that starts with the same
tokens holds the same physical page. Pages read from outside (a disk store) come in sealed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import mlx.core as mx

from kv_cache.pages.hashing import page_hash

if TYPE_CHECKING:
    from kv_cache.pages.meta import PageMeta


class Sealing:
    """Seals, deduplication and lookups by content (``self.index``, ``self._meta``,
    ``self.storage``, ``self.policy``, ``allocate``, ``write``, ``hold`` and ``release`` are the
    pool's)."""

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
        existing = self.index.find(h, meta.tokens)
        if existing is not None:
            self.hold(existing)
            self.release(block)
            return existing
        meta.sealed, meta.hash, meta.parent = True, h, parent
        if self.index.lookup(h) is None:  # else a collision: sealed, not indexed
            self._enter(block, meta)
        return block

    def _enter(self, block: int, meta: PageMeta) -> None:
        """Enter a sealed page (its hash and parent set) in the prefix index and the policy."""
        self.index.enter(block, meta)
        self.policy.insert(block, ident=meta.hash)

    def add_sealed(self, parent: bytes, tokens: Sequence[int], kv: mx.array,
                   group: int = 0, h: bytes | None = None) -> int:
        """A sealed page of ``group`` built from outside data (a disk store); held once by the
        caller. ``h``: its hash where the caller has it (``page_hash(parent, tokens)``)."""
        h = page_hash(parent, tokens) if h is None else h
        existing = self.index.find(h, tuple(tokens))
        if existing is not None:
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
        assert all(self.index.lookup(h) is None for h, _ in pages), "a page of the run is cached"
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
        self.storage.add_run(array, blocks)
        self._num_cached += len(blocks)
        self._cached_bytes += len(blocks) * self.group_page_bytes[group]
        return blocks

    def match_prefix(self, tokens: Sequence[int], group: int = 0) -> list[int]:
        """The indexed full pages of ``group`` that hold the longest page-aligned prefix of
        ``tokens``. Not held: the caller holds what it keeps."""
        return self.index.match_prefix(tokens, group)

    def lookup(self, h: bytes) -> int | None:
        """The indexed block holding the sealed page with chain hash ``h`` (not held)."""
        return self.index.lookup(h)

    def match_hashes(self, hashes: Sequence[bytes], tokens: Sequence[int]) -> list[int | None]:
        """For each chain hash of ``hashes`` (pages of ``tokens``), the indexed block holding it
        with the same tokens, or None. Not held."""
        return self.index.match_hashes(hashes, tokens)

    def chain(self, tokens: Sequence[int], group: int = 0) -> list[bytes]:
        """The chain hashes of every full page of ``tokens`` in ``group``."""
        return self.index.chain(tokens, group)
