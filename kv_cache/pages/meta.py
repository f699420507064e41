"""A page's metadata (``PageMeta``): what the pool and its prefix index read about a page
besides its data. The pool owns every page's ``PageMeta``; the index reads it, and marks the
pages it enters (``indexed``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PageMeta:
    ref_count: int = 0
    sealed: bool = False
    tokens: tuple[int, ...] = ()
    hash: bytes | None = None  # chained content hash, set when sealed
    parent: bytes | None = None  # hash of the page before it (the root hash for the first)
    indexed: bool = False  # entered in the prefix index (False only on a hash collision)
    group: int = 0  # the cache spec's group whose layers the page holds
    extras: tuple = ()  # its image keys (``kv_cache.pages.spans.page_extras``), set when sealed
