"""Finding a prompt's cache on disk by its content, as the page pool's prefix index does in
memory: for a prompt whose message ids the store does not hold (or that has none).

The store's files are content-addressed: a page file is named by its chain hash (the model,
the cache group, every token before it and its own), and its parent hash and tokens are in the
store's index (read from its header when it was written or indexed). So the prompt's own chain
hashes name the page files that hold its prefix, and the pages and tail files continuing the
last of them (the index's ``_kids``) hold the partial page after it: the first positions of any
of them whose tokens (and image keys) the prompt begins with are valid keys and values for it.
A prompt's image spans go into its chain hashes as into the pool's, and a prefix found never
ends inside an image. Every hit is
compared by tokens too (invariant 3), and a lookup reads no file: the restore then reads only
the pages and the one tail page it uses.

A recurrent state exists only where an entry ends (its manifest holds it), so for such models
the lookup finds the longest entry that the prompt contains whole, by where entries end (the
index's ``_ends``: group 0's chain hash of the page each ends in), and the entry is restored as
one found by its message id is.

A ``DiskStore`` holds one ``ContentLookup`` over its index and calls it under its lock.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kv_cache.pages.hashing import chain_hashes
from kv_cache.pages.spans import Extra, Span, agree, extras_agree, outside, page_extras
from kv_cache.tiers.base import FoundPrefix
from kv_cache.tiers.disk.index import StoreIndex
from kv_cache.tokens import common_prefix


class ContentLookup:
    """Lookups by content over a ``DiskStore``'s in-memory index (no file is read)."""

    def __init__(self, index: StoreIndex):
        self.index, self.geo, self.page_size = index, index.geo, index.geo.page_size

    def find_end(self, toks: np.ndarray, spans: Sequence[Span] = ()) -> str | None:
        """The key of the longest entry whose tokens are all a prefix of ``toks`` (verified
        token for token) and whose image spans are ``spans`` there, or None."""
        groups, ix = self.geo.spec.groups, self.index
        # Every entry stores all of a full-attention group 0's pages and its tail's holder.
        pruned = bool(groups) and groups[0].kind.reads_all
        best, best_n = None, 0
        for parent in [self.geo.root(0)] + chain_hashes(self.geo.root(0), toks, self.page_size,
                                                        spans=spans):
            keys = ix.ends.get(parent, ())
            if pruned and not keys and not ix.kids.get(parent):
                break  # no stored file continues this page: no entry ends further on
            for key in keys:
                e = ix.entries[key]
                n = len(e.tokens)
                if best_n < n <= len(toks) and np.array_equal(e.tokens, toks[:n]) \
                        and agree(n, e.spans, spans) == n:
                    best, best_n = key, n
        return best

    def find_prefix(self, toks: np.ndarray, spans: Sequence[Span] = ()) -> FoundPrefix | None:
        """The longest prefix of ``toks`` (with image ``spans``) whose keys and values stored
        page and tail files hold for every cache group, a sliding window's group from the first
        page its window reads there, never ending inside an image; None when there is none."""
        P, groups, limit = self.page_size, self.geo.spec.groups, len(toks)
        pages = limit // P
        hashes: list[list[bytes]] = [[] for _ in groups]
        have: list[list[bool]] = [[] for _ in groups]
        for g, spec in enumerate(groups):  # full attention first: they bound the others
            if spec.kind.reads_all:
                hashes[g], have[g] = self._chain(toks, g, pages, True, spans)
                pages = min(pages, len(hashes[g]))
        for g, spec in enumerate(groups):
            if not spec.kind.reads_all:
                hashes[g], have[g] = self._chain(toks, g, pages, False, spans)
        for j in range(pages, -1, -1):
            # NOTE: an earlier page boundary, or a shorter entry's partial page after it, may
            # have its window (a longer entry keeps only the pages its own end's window reads)
            head = [ok[:j] for ok in have]
            tails = {}
            for g in range(len(groups)):  # the partial page after ``j`` full ones
                parent = hashes[g][j - 1] if j else self.geo.root(g)
                tails[g] = self._tail(g, parent, toks[j * P : (j + 1) * P],
                                      page_extras(spans, j * P, P))
            k = min(t[1] for t in tails.values())
            k = outside(j * P + k, spans) - j * P
            if k > 0 and self._window_ok(head, j * P + k):
                return FoundPrefix(j * P + k, [hs[:j] for hs in hashes],
                                   {g: h for g, (h, _) in tails.items()})
            if j and outside(j * P, spans) == j * P and self._window_ok(head, j * P):
                return FoundPrefix(j * P, [hs[:j] for hs in hashes], {})
        return None

    def _chain(self, toks: np.ndarray, g: int, n: int, stop: bool,
               spans: Sequence[Span]) -> tuple[list[bytes], list[bool]]:
        """The chain hashes of the first ``n`` full pages of ``toks`` (with image ``spans``) in
        group ``g`` and whether the store has each page (``stop``: up to the first it does not
        have)."""
        P = self.page_size
        hashes = chain_hashes(self.geo.root(g), toks[: n * P], P, spans=spans)
        files = [self.index.info.get(h) if h in self.index.pages else None for h in hashes]
        have = [f is not None and not f.partial and f.group == g for f in files]
        found = [i for i, ok in enumerate(have) if ok]
        if found:  # the tokens of every page found, checked in one comparison
            stored = np.stack([files[i].tokens for i in found])
            same = (stored == toks[: len(hashes) * P].reshape(-1, P)[found]).all(axis=1)
            for i, ok in zip(found, same.tolist()):
                have[i] = ok
        if stop and not all(have):
            i = have.index(False)
            return hashes[:i], have[:i]
        return hashes, have

    def _tail(self, g: int, parent: bytes, chunk: np.ndarray,
              extras: Sequence[Extra]) -> tuple[bytes | None, int]:
        """The stored file continuing ``parent`` in group ``g`` whose tokens (and image keys:
        ``extras``, the prompt's page's) share the longest prefix with ``chunk`` (a full page
        first at a tie), and that prefix's length."""
        best, rank = None, (0, False)
        for h in self.index.kids.get(parent, ()) if len(chunk) else ():
            f = self.index.info[h]
            if f.group == g:
                n = common_prefix(f.tokens.tolist(), chunk.tolist())
                r = (extras_agree(n, f.extras, extras), not f.partial)
                if r > rank:
                    best, rank = h, r
        return best, rank[0] if best is not None else 0

    def _window_ok(self, have: list[list[bool]], n: int) -> bool:
        """Whether every group has the full pages it reads after ``n`` positions (a sliding
        window's may be missing; ``have`` covers full pages only: the partial page, if any, was
        found apart)."""
        P = self.page_size
        return all(all(ok[spec.kind.pages(n, P)]) for spec, ok in zip(self.geo.spec.groups, have))
