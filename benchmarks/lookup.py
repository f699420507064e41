"""Lookup time of ``CacheManager.find`` for a request with many messages, after a restart (the
memory tier empty, every candidate on disk only), with the store's index built at start-up.

Scenarios (one run):
  one_stored   500 message ids, 1 of them stored (the other 499 unknown to the store);
  all_stored   500 message ids, every second one stored (a long chat whose turns each left an
               entry): the reverse scan stops at the newest id that verifies.
Prints the median and max over ``--repeat`` calls and the file reads during them (counted by
wrapping ``os.pread``). The result goes to benchmarks/results/lookup/<run's UTC time>.json unless
--json names a file. Usage: .venv/bin/python -m benchmarks.lookup [--repeat 50] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.record import OVERRIDE_HELP, write
from kv_cache.tiers.base import PageRecord
from kv_cache.tiers.disk.store import DiskStore
from kv_cache.pages.hashing import chain_hashes
from kv_cache.manager import CacheManager
from kv_cache.pages.pool import PagePool

P, LAYERS, HEADS, DIM = 16, 1, 1, 8  # the KV size does not enter a lookup


def message_tokens(i: int, per: int) -> list[int]:
    return [(i * 7919 + j) % 32000 for j in range(per)]


def build(root: Path, pool: PagePool, n_messages: int, per: int, stored: list[int]) -> list[int]:
    """A store holding an entry for each message index in ``stored``; returns the prompt."""
    prompt = [t for i in range(n_messages) for t in message_tokens(i, per)] + [1, 2, 3]
    with DiskStore(root, fingerprint="bench", spec=pool.spec, page_size=P,
                   max_bytes=1 << 34) as s:
        for i in stored:
            toks = prompt[: (i + 1) * per]
            hs = chain_hashes(pool.roots[0], toks, P)
            recs = [PageRecord(h, tuple(toks[j * P : (j + 1) * P]),
                               None if s.has_page(h) else mx.zeros((LAYERS, 2, HEADS, P, DIM)))
                    for j, h in enumerate(hs)]
            tail = len(toks) % P
            if tail:
                recs.append(PageRecord(None, tuple(toks[-tail:]),
                                       mx.zeros((LAYERS, 2, HEADS, tail, DIM))))
            assert s.put(f"m{i}", toks, recs)
    return prompt


def measure(root: Path, pool: PagePool, prompt: list[int], keys: list[str], repeat: int) -> dict:
    store = DiskStore(root, fingerprint="bench", spec=pool.spec, page_size=P, max_bytes=1 << 34)
    m = CacheManager(pool, store)
    n_stored = len(store.keys())
    reads = []
    real = os.pread
    os.pread = lambda *a: reads.append(a[1]) or real(*a)
    try:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            match = m.find(prompt, keys)
            times.append(time.perf_counter() - t0)
    finally:
        os.pread = real
        m.close()
    return {"messages": len(keys), "stored": n_stored, "match": match.source,
            "tokens_matched": match.tokens, "prompt_tokens": len(prompt),
            "median_ms": round(statistics.median(times) * 1e3, 3),
            "max_ms": round(max(times) * 1e3, 3), "file_reads": len(reads)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=500)
    ap.add_argument("--tokens-per-message", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    n, per = args.messages, args.tokens_per_message
    keys = [f"m{i}" for i in reversed(range(n))]  # newest first, as the server passes them
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-lookup-") as tmp:
        for name, stored in (("one_stored", [n // 2]), ("all_stored", list(range(1, n, 2)))):
            pool = PagePool(LAYERS, HEADS, DIM, page_size=P, dtype=mx.float32,
                            max_bytes=1 << 26, fingerprint="bench")
            root = Path(tmp) / name
            prompt = build(root, pool, n, per, stored)
            out[name] = measure(root, pool, prompt, keys, args.repeat)
    print(json.dumps(out, indent=1))
    write("lookup", json.dumps(out, indent=1), override=args.json)


if __name__ == "__main__":
    main()
