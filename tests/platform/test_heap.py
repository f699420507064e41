"""Giving the C allocator's free pages back (``platform/heap.py``): on glibc, a heap whose freed
chunks sit below chunks still held keeps them resident until they are handed back."""

from __future__ import annotations

import ctypes
import sys

import psutil

from mlx_kvserver.platform import heap


def glibc() -> bool:
    return sys.platform.startswith("linux") and bool(
        getattr(ctypes.CDLL(None), "gnu_get_libc_version", None))


def test_free_heap_pages_go_back_to_the_system():
    process = psutil.Process()
    assert heap.available() or not glibc()
    if not heap.available():  # musl, Windows
        assert heap.give_back() is False
        return
    heap.give_back()
    # 64 MiB in 2 KiB blocks (below any mmap threshold: from the heap), one in 16 kept, so
    # the heap's top cannot shrink and the freed blocks stay between held ones
    blocks = [bytes(2048) for _ in range(32768)]
    kept = blocks[::16]
    before_free = process.memory_info().rss
    del blocks
    freed = process.memory_info().rss
    assert heap.give_back() is True
    after = process.memory_info().rss
    if glibc():  # the allocator measured here; a Mac's zones are not measured in this work
        assert before_free - freed < 16 << 20, "freeing alone gave the pages back"
        assert freed - after > 32 << 20, (before_free, freed, after)
    assert len(kept) == 2048
