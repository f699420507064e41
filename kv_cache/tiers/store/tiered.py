"""The local disk tier with a shared store below it, as one tier (``kv_cache.tiers.base.Tier``).

The manager sees one tier: every call goes to the disk first, and only what the disk lacks is
asked of the shared store (``SharedStore``), as SGLang's HiCache asks its storage tier on a
local miss and never mirrors it:

    get         the disk's index, else the store's manifest (one GET; kept for ``load_entry``)
    find_prefix the disk's longest prefix, else as many of the prompt's own page hashes as the
                store holds (EXISTS in batches, to the first absent page); one cache group of
                full attention only (the common case; other models find by manifest)
    load_*      pages from the disk, the rest from the store in pipelined batches, each value
                checked; the longest valid prefix is what loads
    put         the disk's put, then the entry queued for the store (bounded; in the background)

What comes down from the store goes into the pool by the manager's ordinary restore, and onto
the disk with the turn's own entries (their pages are in memory then, and a ``put`` brings the
data of every page: ``has_page``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Collection, Sequence

import mlx.core as mx
import numpy as np

from kv_cache.pages.hashing import chain_hashes, page_hash
from kv_cache.pages.spans import Span, as_spans, outside, page_extras
from kv_cache.tiers.base import FoundPrefix, LoadedEntry, StoredEntry, Tier
from kv_cache.tiers.disk.file_data import as_page, run_dest, to_array
from kv_cache.tiers.store.shared import SharedStore, WriteJob

MANIFESTS = 8  # manifests fetched by ``get``, kept for the ``load_entry`` that follows


class TieredStore:
    """``disk`` (a ``Tier``) over ``shared``: one tier to the manager."""

    def __init__(self, disk: Tier, shared: SharedStore):
        self.disk, self.shared, self.geo = disk, shared, shared.geo
        groups = self.geo.spec.groups
        self.by_content = len(groups) == 1 and groups[0].kind.reads_all \
            and not self.geo.spec.has_state
        self._manifests: OrderedDict[str, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        """What the manager does not ask of a tier (``write_note``, ``root``) is the disk's."""
        return getattr(self.disk, name)

    # -- find -----------------------------------------------------------------------------------

    def get(self, key: str) -> StoredEntry | None:
        found = self.disk.get(key)
        if found is not None:
            return found
        got = self.shared.get_entry(key)
        if got is None:
            return None
        info, _ = got
        with self._lock:
            self._manifests[key] = got
            while len(self._manifests) > MANIFESTS:
                self._manifests.popitem(last=False)
        return StoredEntry(key, tuple(info.tokens), list(info.page_hashes), info.tail_tokens,
                           tuple(info.layout), info.has_state, info.spans)

    def find_prefix(self, prompt: Sequence[int], limit: int,
                    spans: Sequence[Span] = ()) -> FoundPrefix | None:
        spans = as_spans(spans)
        found = self.disk.find_prefix(prompt, limit, spans)
        if not self.by_content:
            return found
        P = self.geo.page_size
        pages = limit // P
        if pages == 0 or (found is not None and found.tokens >= pages * P):
            return found
        hashes = chain_hashes(self.geo.root(0), prompt[: pages * P], P, spans=spans)
        n = self.shared.count_present(hashes)
        n = outside(n * P, spans) // P  # NOTE: never inside an image: back to a page before it
        if n * P <= (found.tokens if found is not None else 0):
            return found
        return FoundPrefix(n * P, [hashes[:n]], {})

    def find_end(self, prompt: Sequence[int], limit: int,
                 spans: Sequence[Span] = ()) -> str | None:
        return self.disk.find_end(prompt, limit, spans)

    def has_page(self, h: bytes) -> bool:
        """Never: a ``put`` brings every page's data (host views of the pool's arrays, no
        copy), as the store may lack any of them (evicted, restarted); the disk skips the pages
        it has, the store's writer those it holds (TOUCH)."""
        return False

    def keys(self) -> list[str]:
        return self.disk.keys()

    # -- load -----------------------------------------------------------------------------------

    def load_entry(self, key: str) -> LoadedEntry | None:
        if self.disk.get(key) is not None:
            return self.disk.load_entry(key)
        with self._lock:
            got = self._manifests.pop(key, None)
        got = got or self.shared.get_entry(key)
        if got is None:
            return None
        info, tensors = got
        P, tokens = self.geo.page_size, tuple(info.tokens)
        tails: dict[int, mx.array] = {}
        if info.tail_tokens:
            tail = tokens[len(tokens) - info.tail_tokens:]
            extras = page_extras(info.spans, len(tokens) - len(tail), len(tail))
            hashes = [page_hash(parent, tail, extras) for parent in info.tail_parents]
            for g, found in enumerate(self.shared.load_pages(hashes, tail=True, stop=False)):
                if found is not None:
                    tails[g] = to_array(*found)
        state = None
        if info.has_state:
            state = [[tensors[f"state.{si}.{i}"] for i in range(len(s.shapes))]
                     for si, s in enumerate(self.geo.spec.states)]
        stored = StoredEntry(key, tokens, list(info.page_hashes), len(tokens) % P,
                             tuple(info.layout), info.has_state, info.spans)
        return LoadedEntry(stored, tails, state)

    def load_page(self, h: bytes) -> mx.array | None:
        return self.load_pages([h])[h]

    def load_pages(self, hashes: Sequence[bytes]) -> dict[bytes, mx.array | None]:
        out = self.disk.load_pages(hashes)
        missing = [h for h in dict.fromkeys(hashes) if out.get(h) is None]
        if missing:
            for h, found in zip(missing, self.shared.load_pages(missing, stop=False)):
                if found is not None:
                    out[h] = to_array(*found)
        return out

    def load_run(self, hashes: Sequence[bytes], group: int) -> tuple[mx.array | None, int]:
        """The disk's run; where the disk has none of it, the store's: each page checked and
        copied once, straight into the run's MLX array (``run_dest``). A run the disk has a
        part of stays the disk's (the rest then loads page by page, from the store too)."""
        arr, k = self.disk.load_run(hashes, group)
        if k or not hashes:
            return arr, k
        got = self.shared.load_pages(hashes)
        n = (got + [None]).index(None)
        if n == 0:
            return None, 0
        arr, parts = run_dest(self.geo, group, len(hashes))
        for part, (view, _) in zip(parts, got[:n]):
            part[...] = view.view(np.uint8).reshape(part.shape)
        return as_page(arr, self.geo, group), n

    def load_holder(self, h: bytes) -> mx.array | None:
        return self.disk.load_holder(h)

    # -- save and evict -------------------------------------------------------------------------

    def put(self, key: str, tokens: Sequence[int], pages: Sequence, pinned: Collection[str] = (),
            *, tails: dict | None = None, layout: Sequence[tuple[int, int]] | None = None,
            state=None, spans: Sequence[Span] = ()) -> bool:
        """The disk's put, then the entry queued for the store."""
        ok = self.disk.put(key, tokens, pages, pinned, tails=tails, layout=layout, state=state,
                           spans=spans)
        layout = list(layout) if layout is not None else [(0, len(pages))]
        self.shared.submit(WriteJob(key, tuple(int(t) for t in tokens), list(pages),
                                    dict(tails or {}), layout, state, as_spans(spans)))
        return ok

    def touch(self, key: str) -> None:
        self.disk.touch(key)

    def delete(self, key: str) -> bool:
        """Remove ``key`` from the disk and its manifest from the store (a deleted entry must
        not come back from there)."""
        self.shared.delete_entry(key)
        return self.disk.delete(key)

    def stats(self):
        return self.disk.stats()

    def close(self) -> None:
        self.shared.close()
        self.disk.close()

