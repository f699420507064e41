"""Disk copies of entries (kv_cache/saving.py): what a write holds goes when the write is done."""

from __future__ import annotations

import gc

import mlx.core as mx

from kv_cache.manager import CacheManager
from tests.kv_cache.test_manager import model, pool_for, run, store_for  # noqa: F401 (fixture)


def test_an_entry_on_disk_and_shed_from_memory_leaves_no_bytes_behind(model, tmp_path):
    """The writer thread kept its last task, which holds the entry's pages (host views of their
    MLX arrays), until the next write came: an entry given back under memory pressure stayed in
    memory, one entry's bytes above what the budget counted (seen as ~185 MB of "working"
    bytes in the 4,000-token cell of an earlier run of benchmarks/memory_peak.py, in
    docs/BENCHMARKS.md's git history)."""
    m = CacheManager(pool_for(model, max_bytes=1 << 26), store_for(pool_for(model), tmp_path))
    tokens = [5 + i % 200 for i in range(1000)]
    gc.collect()
    base = mx.get_active_memory()
    seq, _ = m.start(tokens, [])
    run(model, seq, tokens)
    m.save("k", seq)
    seq.close()
    del seq
    m.sync()  # the disk holds it
    entry_bytes = m.pool.stats().used_bytes
    assert entry_bytes > 100_000
    m.shed()  # on disk: given back from memory
    gc.collect()
    assert m.pool.stats().used_bytes == 0
    assert mx.get_active_memory() - base < entry_bytes // 4
    match = m.find(tokens, ["k"])  # and still there, from disk
    assert match.tokens == 999 and match.source == "disk:k"  # the last token is read again
    m.close()
