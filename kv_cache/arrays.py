"""Named arrays kept by a key of the user's (``CacheManager.get_arrays``, ``put_arrays``): what
is costly to compute but can always be computed again, kept in memory (least recently used
first out, within ``max_bytes``) and on the disk tier (``kv_cache.tiers.disk.arrays``: in the
disk budget, evicted in policy order with the entries). The library knows nothing of what
they are; the server keeps a vision encoder's output by the image's pixel hash.

The disk copy is written by the manager's disk writer (``Saving.submit``), off the generating
thread: the arrays go over as host bytes, evaluated here. Under memory pressure the memory copy
is the first thing given back (``clear``): the disk, or computing them again, has them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Callable, Mapping

import mlx.core as mx

from kv_cache.tiers.base import Tier
from kv_cache.tiers.disk.arrays import host_arrays

log = logging.getLogger("kv_cache.manager")


@dataclass(slots=True)
class ArraysStats:
    """What ``KeptArrays.stats`` reports: hits from memory and from disk, misses, keys put,
    disk copies written or refused, and what memory holds now."""

    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    puts: int = 0
    disk_saves: int = 0
    disk_save_failures: int = 0
    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0


class KeptArrays:
    """Arrays by key in memory within ``max_bytes``, over ``store`` (a tier with keyed arrays,
    or None: memory only); disk writes go to ``submit`` (run in order off this thread)."""

    def __init__(self, store: Tier | None, max_bytes: int,
                 submit: Callable[[Callable[[], None]], None] | None):
        self.store = store if store is not None and hasattr(store, "put_arrays") else None
        self.submit = submit
        self.max_bytes = max(0, int(max_bytes))
        self._memory: OrderedDict[str, tuple[dict[str, mx.array], int]] = OrderedDict()
        self.nbytes = 0
        self.counts = ArraysStats()

    def has(self, key: str) -> bool:
        """Whether ``key``'s arrays are kept, in memory or on disk (no file read)."""
        return key in self._memory or (self.store is not None and self.store.has_arrays(key))

    def get(self, key: str) -> dict[str, mx.array] | None:
        """``key``'s arrays from memory, else from disk (then kept in memory too); None (a
        miss) when neither has them."""
        got = self._memory.get(key)
        if got is not None:
            self._memory.move_to_end(key)
            self.counts.memory_hits += 1
            return dict(got[0])
        arrays = self.store.load_arrays(key) if self.store is not None else None
        if arrays is None:
            self.counts.misses += 1
            return None
        self.counts.disk_hits += 1
        self._keep(key, arrays)
        return dict(arrays)

    def put(self, key: str, arrays: Mapping[str, mx.array]) -> None:
        """Keep ``arrays`` under ``key``, in memory and (by the disk writer) on disk. Arrays
        the disk cannot keep (a dtype it has no code for) stay in memory only (logged)."""
        arrays = dict(arrays)
        self.counts.puts += 1
        if self.store is not None and self.submit is not None:
            try:
                host = host_arrays(arrays)
            except ValueError as e:
                log.info("arrays under a key kept in memory only: %s", e)
            else:
                self.submit(lambda: self._write(key, host))
        self._keep(key, arrays)

    def _write(self, key: str, host) -> None:
        if self.store.put_arrays(key, host):
            self.counts.disk_saves += 1
        else:
            self.counts.disk_save_failures += 1

    def _keep(self, key: str, arrays: dict[str, mx.array]) -> None:
        """``arrays`` in memory as the most recently used, the least recently used going while
        over ``max_bytes`` (arrays larger than it alone are not kept in memory)."""
        size = sum(a.nbytes for a in arrays.values())
        if key in self._memory:
            self.nbytes -= self._memory.pop(key)[1]
        if size > self.max_bytes:
            return
        self._memory[key] = (arrays, size)
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            self.nbytes -= self._memory.popitem(last=False)[1][1]

    def clear(self) -> int:
        """Give back every array held in memory (the disk keeps its copies); the bytes freed."""
        freed = self.nbytes
        self._memory.clear()
        self.nbytes = 0
        return freed

    def stats(self) -> dict:
        return {**asdict(self.counts), "entries": len(self._memory), "bytes": self.nbytes,
                "budget_bytes": self.max_bytes}
