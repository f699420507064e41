"""What the tiers tell an observer of the pages they hold: the hook a publisher of KV cache
events (vLLM's ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) hangs on.

A page is *stored* in a tier when the tier comes to hold it findable by its chain hash
(``kv_cache.pages.hashing``), and *removed* when the tier lets it go; only sealed full pages
count (an open tail page has no hash). The tiers are told apart by their medium:

    ``MEDIUM_RAM``    "GPU"       the page pool's indexed pages: the memory the model reads
                                  (vLLM's name for the tier its model reads from)
    ``MEDIUM_DISK``   "DISK"      page files of the disk store (the KV cache directory)
    ``MEDIUM_STORE``  "EXTERNAL"  pages this server wrote to the shared store (``--kv-store``);
                                  the store evicts by itself, unseen, so no removal is told

An observer (``CacheEvents``) is called from whichever thread changes a tier (the generating
thread for memory, the disk writer for the disk, the store writer for the store), sometimes
under a tier's lock: it must return at once (a queue put) and never call back into the cache.
``kv_cache.events.watch_pages`` attaches one to a manager (and detaches it). Nothing in the cache
clears every tier at once: a publisher says all is cleared itself, when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

from kv_cache.pages.spans import Extra

MEDIUM_RAM = "GPU"
MEDIUM_DISK = "DISK"
MEDIUM_STORE = "EXTERNAL"
MEDIA = (MEDIUM_RAM, MEDIUM_DISK, MEDIUM_STORE)


@dataclass(frozen=True, slots=True)
class StoredPage:
    """A sealed full page as an observer is told of it."""

    hash: bytes  # its chained content hash
    parent: bytes | None  # its parent's hash; None for a group's first page (the chain's root)
    tokens: tuple[int, ...]  # its token ids (page size of them)
    extras: tuple[Extra, ...] = ()  # its image keys (``kv_cache.pages.spans.page_extras``)
    group: int = 0  # the cache group whose layers it holds


class CacheEvents(Protocol):
    """What the tiers tell an observer. Each call must return at once (see the module)."""

    def stored(self, medium: str, pages: Sequence[StoredPage]) -> None:
        """``pages`` (parents before children) became held in the tier ``medium``."""

    def removed(self, medium: str, hashes: Sequence[bytes]) -> None:
        """The pages ``hashes`` left the tier ``medium``."""


def in_chain_order(pages: Iterable[StoredPage]) -> list[StoredPage]:
    """``pages`` with every page after its parent where the parent is among them."""
    by_hash = {p.hash: p for p in pages}
    out: list[StoredPage] = []
    done: set[bytes] = set()
    for p in by_hash.values():
        trail = []
        while p is not None and p.hash not in done:
            done.add(p.hash)
            trail.append(p)
            p = by_hash.get(p.parent) if p.parent is not None else None
        out.extend(reversed(trail))
    return out
