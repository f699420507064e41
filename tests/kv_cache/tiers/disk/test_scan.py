"""The start-up scan (``scan``): the index rebuilt from headers only, recency kept, temp files,
orphans and special files removed, a smaller budget applied oldest first."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from kv_cache.tiers.disk import atomic_fs as afs
from kv_cache.tiers.disk import file_format as fmt
from kv_cache.tiers.disk.index import entry_name
from tests.kv_cache.tiers.disk.disk_helpers import (
    SMALL, SMALL_TOKS, bits, check_accounting, conv, data_files, entry_bytes, entry_path, hashes,
    install, page_of, page_path, records, tail_of, tree,
)


def test_restart_indexes_from_headers_only(tmp_path, stores, monkeypatch):
    s = stores(tmp_path)
    convs = {f"k{i}": list(range(i, i + 4 * i + 3)) for i in range(1, 6)}
    for k, t in convs.items():
        assert s.put(k, t, records(t))
    s.touch("k2")
    before = s.stats()
    s.close()
    header_bytes = sum(8 + struct.unpack("<Q", (tmp_path / f).read_bytes()[:8])[0]
                       for f in data_files(tmp_path))
    read = []
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: read.append(n) or real_pread(fd, n, off))

    def no_data(*a, **k):
        raise AssertionError("tensor data read during start-up or get()")

    monkeypatch.setattr(afs, "read_all", no_data)
    monkeypatch.setattr(fmt, "from_storage", no_data)
    s = stores(tmp_path)
    assert s.keys() == ["k1", "k3", "k4", "k5", "k2"]  # recency survives (touch = mtime)
    for k, t in convs.items():
        e = s.get(k)
        assert e.tokens == tuple(t) and e.page_hashes == hashes(t)
    for k in ("bytes_on_disk", "entries", "pages"):
        assert getattr(s.stats(), k) == getattr(before, k)
    assert sum(read) <= header_bytes  # headers read at start-up; get() reads no file
    monkeypatch.undo()
    t = convs["k3"]
    assert np.array_equal(bits(page_of(s, hashes(t)[1])), bits(records(t)[1].data))
    assert np.array_equal(bits(tail_of(s, "k3")), bits(records(t)[-1].data))


def test_leftover_temp_files_and_orphan_pages_are_removed_at_start(tmp_path, stores):
    src, tmp_path = tmp_path / "o", tmp_path / "s"
    s = stores(tmp_path)
    toks = list(range(9))
    assert s.put("k", toks, records(toks))
    s.close()
    h = hashes(toks)[0]
    (tmp_path / "entries" / (".tmp.1.abc." + entry_name("x"))).write_bytes(b"half")
    (page_path(tmp_path, h).parent / (".tmp.2.def." + h.hex() + ".safetensors")).write_bytes(b"x")
    (tmp_path / "pages" / ".tmp.3.x").write_bytes(b"y")
    orphan = records(list(range(50, 54)))[0]
    page_path(tmp_path, orphan.hash).parent.mkdir()
    with stores(src) as o:
        o.put("o", list(range(50, 54)), [orphan])
    os.replace(page_path(src, orphan.hash), page_path(tmp_path, orphan.hash))
    s = stores(tmp_path)
    assert s.stats().temp_files_removed == 3
    assert not s.has_page(orphan.hash) and not page_path(tmp_path, orphan.hash).exists()
    assert s.keys() == ["k"] and s.get("k").tokens == tuple(toks)
    assert not [f for f in tree(tmp_path) if ".tmp." in f]
    check_accounting(s, tmp_path)


def test_special_files_are_not_opened(tmp_path, stores):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    h = hashes(SMALL_TOKS, SMALL)[0]
    install(tmp_path, h, None, None)
    os.mkfifo(page_path(tmp_path, h))
    os.mkfifo(entry_path(tmp_path, "k"))
    s = stores(tmp_path, **SMALL)  # would hang if a FIFO were opened for reading blocking
    assert s.keys() == [] and not os.path.lexists(page_path(tmp_path, h))


def test_a_smaller_budget_at_start_evicts_oldest_first(tmp_path, stores):
    size = entry_bytes(tmp_path, stores)
    root = tmp_path / "s"
    s = stores(root)
    for i, k in enumerate("abcd"):
        assert s.put(k, conv(i), records(conv(i)))
    s.touch("a")
    s.close()
    s = stores(root, max_bytes=2 * size)
    assert s.keys() == ["d", "a"] and s.stats().evictions == 2
    check_accounting(s, root)
