"""What the manager asks of a tier below memory (the disk store, a shared page store): one small
interface and the plain values that cross it.

A tier keeps pages by content (a sealed full page by its chain hash, ``kv_cache.pages.hashing``)
and entries by message id: an entry is the token ids of a finished turn, the hashes of its full
pages per cache group, its open tail page per group and, for a model with one, its recurrent
state, and the image spans among its tokens (``kv_cache.pages.spans``). The manager's calls, by
what they are for:

    find    ``get`` (an entry by its key, from the tier's index: no page read), ``find_prefix``
            and ``find_end`` (by a prompt's content), ``has_page``, ``keys``
    load    ``load_entry`` (its tail pages and state), ``load_pages``, ``load_run``,
            ``load_holder`` (the data holding a found prefix's partial page)
    save    ``put``, ``touch`` (a hit: the entry becomes the most recently used)
    evict   ``delete``; a tier evicts on its own to keep within its budget on ``put``
    arrays  ``has_arrays``, ``put_arrays``, ``load_arrays``: named arrays by a key of the
            user's (``kv_cache.arrays``), the disk tier's alone (optional: a tier without them
            keeps none)
    stats   ``stats``: one dataclass of the tier's own, whose ``dataclasses.asdict`` is what the
            server shows (``/v1/kv_cache/stats``, ``/metrics`` read ``entries``,
            ``bytes_on_disk``, ``budget``, ``evictions`` and ``errors`` where present)

Only plain values cross it (token ids, hashes, MLX or host arrays and the dataclasses below),
never a tier's internals, so the manager works over any tier the same way. A tier never calls
up into the manager or the pool. Every read checks what it reads: a missing, damaged or
foreign page or entry is a miss (None), never an exception. Token ids (and image spans) always
decide how much of a stored entry is valid (docs/ARCHITECTURE.md, invariant 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Protocol, Sequence

import mlx.core as mx
import numpy as np

from kv_cache.pages.spans import Span

if TYPE_CHECKING:
    from kv_cache.pages.pool import PagePool


@dataclass
class PageRecord:
    """A page handed to ``put``: a sealed full page (``hash`` set) or the entry's open tail."""

    hash: bytes | None  # chained content hash of a sealed full page; None for the open tail page
    tokens: tuple[int, ...]
    # [layers, 2, kv_heads, n, head_dim], MLX or host bytes (``host_array``); None if the tier
    # has the page (``has_page``)
    data: mx.array | np.ndarray | None
    group: int = 0  # the cache group whose layers the page holds


@dataclass
class StoredEntry:
    """An entry as a tier's index describes it (``get``: no page or tail read)."""

    key: str  # the original message_id
    tokens: tuple[int, ...]  # all tokens of the entry
    page_hashes: list[bytes]  # sealed full pages, in order, group after group
    tail_tokens: int  # tokens in the open tail page (0 if none)
    layout: tuple[tuple[int, int], ...] = ()  # per group: (pages not stored, pages stored)
    has_state: bool = False  # carries the recurrent state after its tokens
    spans: tuple[Span, ...] = ()  # the image spans among its tokens (``pages.spans``)

    def group_hashes(self) -> list[list[bytes | None]]:
        """Per group, the hash of each full page (None where the entry does not store it)."""
        out, at = [], 0
        for skip, count in self.layout or ((0, len(self.page_hashes)),):
            out.append([None] * skip + list(self.page_hashes[at : at + count]))
            at += count
        return out


@dataclass
class LoadedEntry:
    """An entry as read back and verified: its description, open tail pages, recurrent state."""

    entry: StoredEntry
    tails: dict[int, mx.array]  # per group (empty when the entry ends on a page boundary)
    state: list[list[mx.array]] | None  # per state slot, its arrays


@dataclass(slots=True)
class FoundPrefix:
    """A prefix of a prompt that a tier's pages hold (``find_prefix``): its first ``tokens``
    positions."""

    tokens: int
    hashes: list[list[bytes]]  # per group, the chain hash of each full page (tokens // P)
    tails: dict[int, bytes]  # per group, what holds the partial page after (``load_holder``)


def host_array(a: mx.array) -> np.ndarray:
    """``a``'s raw bytes as a numpy array (zero-copy for float16/float32; bfloat16 as its 16-bit
    words), for handing page data to a thread that must not run MLX (``PageRecord.data``)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    mx.eval(a)
    return np.asarray(a)


class Tier(Protocol):
    """A tier below memory, as the manager uses it (the calls it makes, nothing more). Calls may
    come from the generating thread and the disk writer thread at once: a tier locks."""

    # -- find ---------------------------------------------------------------------------------

    def get(self, key: str) -> StoredEntry | None:
        """``key``'s entry from the tier's index (no page read), or None."""

    def find_prefix(self, prompt: Sequence[int], limit: int,
                    spans: Sequence[Span] = ()) -> FoundPrefix | None:
        """The longest prefix of ``prompt[:limit]`` (with image ``spans``: the page hashes
        carry them) whose pages the tier holds for every cache group (a sliding window's group
        from the first page its window reads); None if none."""

    def find_end(self, prompt: Sequence[int], limit: int,
                 spans: Sequence[Span] = ()) -> str | None:
        """The key of the longest entry whose tokens are all a prefix of ``prompt[:limit]``
        (verified token for token) and whose image spans are the prompt's ``spans`` there, or
        None."""

    def has_page(self, h: bytes) -> bool:
        """Whether the tier holds sealed full page ``h`` (``put`` then needs no data for it)."""

    def keys(self) -> list[str]:
        """Every entry's key, least recently used first."""

    # -- load ---------------------------------------------------------------------------------

    def load_entry(self, key: str) -> LoadedEntry | None:
        """The entry read and verified, with its open tail pages and recurrent state; None when
        missing or damaged."""

    def load_pages(self, hashes: Sequence[bytes]) -> dict[bytes, mx.array | None]:
        """Per hash, the page's data ``[layers, 2, kv_heads, page_size, head_dim]`` verified,
        None when missing or damaged."""

    def load_run(self, hashes: Sequence[bytes], group: int) -> tuple[mx.array | None, int]:
        """Consecutive full pages of ``group`` in one array ``[layers, 2, kv_heads, n *
        page_size, head_dim]`` and how many of them, from the first, it holds verified (None, 0
        when the first is missing)."""

    def load_holder(self, h: bytes) -> mx.array | None:
        """The data of what holds a found prefix's partial page (``FoundPrefix.tails``), all of
        its positions; None when missing or damaged."""

    # -- save and evict -----------------------------------------------------------------------

    def put(self, key: str, tokens: Sequence[int], pages: Sequence[PageRecord],
            pinned: Collection[str] = (), *, tails: dict | None = None,
            layout: Sequence[tuple[int, int]] | None = None, state=None,
            spans: Sequence[Span] = ()) -> bool:
        """Save ``key``: its sealed full pages in order (group after group; ``layout``: per
        group, how many leading pages are left out and how many follow), its open tail page per
        group (``tails``), its recurrent ``state`` (per state slot, its arrays) and the image
        ``spans`` among its tokens (its pages' hashes carry them). True if
        saved, within the tier's budget (evicting entries other than ``key`` and ``pinned``);
        False if it does not fit or the write fails. Inconsistent records are a
        ``ValueError``."""

    def touch(self, key: str) -> None:
        """A hit: ``key`` becomes the most recently used."""

    def delete(self, key: str) -> bool:
        """Remove ``key`` and the pages no other entry uses. True if it was there."""

    # -- stats --------------------------------------------------------------------------------

    def stats(self) -> Any:
        """A snapshot of the tier's counters: one dataclass of the tier's (``DiskStats``)."""

    def close(self) -> None:
        """Finish and release what the tier holds. Idempotent."""


class FoundTails:
    """``get(group)``: the data holding a found prefix's partial page, from the pool where it
    holds that page, else from the tier when first asked for (a restore that stops before the
    partial page reads nothing for it)."""

    def __init__(self, tier: Tier, pool: PagePool, found: FoundPrefix):
        self.tier, self.pool, self.found = tier, pool, found
        self._data: dict[int, mx.array | None] = {}

    def get(self, g: int) -> mx.array | None:
        if g not in self._data:
            h = self.found.tails.get(g)
            block = None if h is None else self.pool.lookup(h)
            self._data[g] = self.pool.data(block) if block is not None \
                else None if h is None else self.tier.load_holder(h)
        return self._data[g]
