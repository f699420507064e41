"""The prefix index: sealed pages by chained content hash, so that every sequence starting with the
same tokens finds the same physical page.

A page's hash chains the model fingerprint and the cache group (the chain's root), the hash of
the page before it and the page's token ids (``kv_cache.pages.hashing``). A hash finds a
candidate; the page's stored tokens decide (a collision is a miss, never wrong KV; a page's image
spans are in its hash alone). The index
also counts, per hash, the indexed pages that continue it: a page nothing continues is a leaf,
and only leaves may be evicted (a cached prefix never loses its middle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from kv_cache.pages.hashing import chain_hashes
from kv_cache.pages.spans import Span

if TYPE_CHECKING:
    from kv_cache.pages.meta import PageMeta


class PrefixIndex:
    """Hash -> block of the pool's sealed pages (their metadata is the pool's ``metas``)."""

    def __init__(self, page_size: int, roots: Sequence[bytes], metas: Mapping[int, PageMeta]):
        self.page_size = page_size
        self.roots = list(roots)  # per cache group, the chain's root hash
        self._metas = metas
        self.blocks: dict[bytes, int] = {}  # hash -> sealed block
        self.children: dict[bytes, int] = {}  # hash -> number of indexed pages continuing it
        self.hits = 0  # pages found by ``match_prefix``

    def enter(self, block: int, meta: PageMeta) -> None:
        """Index a sealed page (its hash and parent set)."""
        meta.indexed = True
        self.blocks[meta.hash] = block
        self.children[meta.parent] = self.children.get(meta.parent, 0) + 1

    def remove(self, meta: PageMeta) -> None:
        """Forget an indexed page (it is being freed)."""
        del self.blocks[meta.hash]
        left = self.children[meta.parent] - 1
        if left:
            self.children[meta.parent] = left
        else:
            del self.children[meta.parent]

    def is_leaf(self, meta: PageMeta) -> bool:
        """Whether no indexed page continues this indexed one."""
        return self.children.get(meta.hash, 0) == 0

    def lookup(self, h: bytes) -> int | None:
        """The indexed block holding the sealed page with chain hash ``h`` (not held)."""
        return self.blocks.get(h)

    def find(self, h: bytes, tokens: tuple[int, ...]) -> int | None:
        """The indexed block with hash ``h`` that holds exactly ``tokens``, or None."""
        b = self.blocks.get(h)
        return b if b is not None and self._metas[b].tokens == tokens else None

    def match_prefix(self, tokens: Sequence[int], group: int = 0,
                     spans: Sequence[Span] = ()) -> list[int]:
        """The indexed full pages of ``group`` that hold the longest page-aligned prefix of
        ``tokens`` (with image ``spans``: their hashes carry them). Not held: the caller holds
        what it keeps."""
        P = self.page_size
        pages, blocks = len(tokens) // P, []
        hashes: list[bytes] = []
        while len(hashes) < pages:  # hashed a run of pages at a time: a miss stops it early
            first = len(hashes)
            hashes = chain_hashes(self.roots[group], tokens[: min(pages, 2 * first + 8) * P], P,
                                  start=hashes, spans=spans)
            for i in range(first, len(hashes)):
                b = self.find(hashes[i], tuple(tokens[i * P : (i + 1) * P]))
                if b is None:
                    self.hits += len(blocks)
                    return blocks
                blocks.append(b)
        self.hits += len(blocks)
        return blocks

    def match_hashes(self, hashes: Sequence[bytes], tokens: Sequence[int]) -> list[int | None]:
        """For each chain hash of ``hashes`` (pages of ``tokens``), the indexed block holding it
        with the same tokens, or None. Not held."""
        P = self.page_size
        return [self.find(h, tuple(tokens[i * P : (i + 1) * P])) for i, h in enumerate(hashes)]

    def chain(self, tokens: Sequence[int], group: int = 0,
              spans: Sequence[Span] = ()) -> list[bytes]:
        """The chain hashes of every full page of ``tokens`` (with image ``spans``) in
        ``group``."""
        return chain_hashes(self.roots[group], tokens, self.page_size, spans=spans)
