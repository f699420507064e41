"""Reading pages for a restore (``reader``): checked against what the index learnt from their
headers, so no header is parsed again; a page changed since, read one by one or as a run, on
one thread or several, is a miss; a transient read error a miss that keeps the file."""

from __future__ import annotations

import errno
import json
import os
import struct

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.tiers.disk import file_format as fmt
from kv_cache.tiers.disk import framing
from tests.kv_cache.tiers.disk.disk_helpers import (
    bits, check_accounting, failing, hashes, page_of, page_path, records, tail_of,
)


def test_a_restore_reads_each_page_once_and_parses_no_header(tmp_path, stores, monkeypatch):
    """Pages are checked against what the index learnt from their headers (at start-up or
    when written): a restore reads the file and hashes it, and parses no header again."""
    toks = list(range(4 * 6 + 1))
    with stores(tmp_path) as s:
        assert s.put("k", toks, records(toks))
    s = stores(tmp_path)  # indexed from the headers at start-up
    for module, where in ((framing, "parse_header"), (fmt, "parse_page"),
                          (framing, "read_header"), (fmt, "parse_entry")):
        monkeypatch.setattr(module, where, lambda *a, w=where, **k: pytest.fail(f"{w} called"))
    got = s.load_pages(hashes(toks))
    for r in records(toks)[:-1]:
        assert np.array_equal(bits(got[r.hash]), bits(r.data))
    monkeypatch.undo()
    # A manifest as indexed: its metadata (tokens, page hashes) is not parsed again.
    monkeypatch.setattr(fmt, "parse_entry", lambda *a, **k: pytest.fail("parse_entry called"))
    e = s.load_entry("k")
    assert e.entry.tokens == tuple(toks) and e.entry.page_hashes == hashes(toks)
    assert np.array_equal(bits(e.tails[0]), bits(records(toks)[-1].data))


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("via", ["pages", "run"])
@pytest.mark.parametrize("change", ["header", "data", "length", "shorter", "fifo"])
def test_a_page_changed_since_it_was_indexed_is_a_miss(tmp_path, stores, monkeypatch, change,
                                                       via, threads):
    """A page file whose bytes differ from what the index recorded, even one still well formed
    with the same data, is a miss and removed; the others load (page by page, or as a run: the
    pages before it), read on one thread or on several (as large pages are)."""
    if threads:
        monkeypatch.setattr("kv_cache.tiers.disk.reader.PARALLEL_PAGE_BYTES", 0)
    toks = list(range(4 * 3))
    s = stores(tmp_path)
    assert s.put("k", toks, records(toks))
    h = hashes(toks)[1]
    path = page_path(tmp_path, h)
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    if change == "header":  # the same JSON with its keys in another order: valid, not ours
        top = json.loads(raw[8 : 8 + n])
        again = json.dumps(dict(reversed(list(top.items()))), separators=(",", ":")).encode()
        again += b" " * (n - len(again))
        assert len(again) == n and again != bytes(raw[8 : 8 + n])
        raw[8 : 8 + n] = again
    elif change == "data":
        raw[8 + n] ^= 1
    elif change == "length":
        raw += b"\0" * 8
    elif change == "shorter":
        del raw[-1]
    path.unlink()
    if change == "fifo":  # not a regular file now: read without blocking, then refused
        os.mkfifo(path)
    else:
        path.write_bytes(bytes(raw))
    if via == "pages":
        got = s.load_pages(hashes(toks))
        assert got[h] is None and all(got[x] is not None for x in hashes(toks) if x != h)
    else:
        arr, k = s.load_run(hashes(toks), 0)
        assert k == 1 and arr is not None
        assert mx.array_equal(arr[:, :, :, :4, :], page_of(s, hashes(toks)[0]),
                              equal_nan=True).item()
    assert not path.exists() and s.stats().corrupt_files_removed == 1
    assert (s._reader._threads is not None) == threads


def test_a_transient_read_error_is_a_miss_that_keeps_the_file(tmp_path, stores, monkeypatch):
    s = stores(tmp_path)
    toks = list(range(6))
    assert s.put("k", toks, records(toks))
    h = hashes(toks)[0]
    for read in ("pread", "preadv", "readv"):  # every read of a file fails
        monkeypatch.setattr(os, read, failing(0, OSError(errno.EIO, "I/O error"),
                                              getattr(os, read)))
    assert page_of(s, h) is None and tail_of(s, "k") is None and s.load_entry("k") is None
    assert s.get("k").tokens == tuple(toks)  # a transient error keeps the entry indexed
    monkeypatch.undo()
    assert s.stats().errors == 3 and s.stats().corrupt_files_removed == 0
    assert s.has_page(h) and s.get("k").tokens == tuple(toks)
    assert np.array_equal(bits(page_of(s, h)), bits(records(toks)[0].data))
    check_accounting(s, tmp_path)
