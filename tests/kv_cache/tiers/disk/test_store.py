"""DiskStore: exact round trips, inconsistent puts refused, pages shared between entries stored
once, one store per root, files removed behind its back, write errors, hostile keys and
planted links."""

from __future__ import annotations

import errno
import os

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.tiers.base import PageRecord
from kv_cache.tiers.disk import atomic_fs as afs
from kv_cache.tiers.disk.dirs import DiskStoreLockedError
from kv_cache.tiers.disk.index import entry_name
from kv_cache.tiers.disk.store import DiskStore
from tests.kv_cache.tiers.disk.disk_helpers import (
    GEO, bits, check_accounting, conv, data_files, entry_bytes, entry_path, failing, hashes,
    page_of, page_path, records, tail_hash, tail_of, tail_path, tree,
)


# -- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_round_trip_is_bit_exact(tmp_path, stores, dtype):
    geo = {**GEO, "dtype": dtype}
    s = stores(tmp_path, dtype=dtype)
    toks = list(range(100, 111))  # 2 full pages + a tail of 3
    recs = records(toks, geo)
    assert s.put("m1", toks, recs)
    e = s.get("m1")
    assert (e.key, e.tokens, e.page_hashes, e.tail_tokens) == ("m1", tuple(toks), hashes(toks), 3)
    for r in recs[:2]:
        assert s.has_page(r.hash)
        got = page_of(s, r.hash)
        assert got.dtype == dtype and got.shape == r.data.shape
        assert np.array_equal(bits(got), bits(r.data))
    tail = tail_of(s, "m1")
    assert tail.dtype == dtype and np.array_equal(bits(tail), bits(recs[2].data))
    s.close()
    s = stores(tmp_path, dtype=dtype)  # and again after a restart
    assert np.array_equal(bits(page_of(s, recs[1].hash)), bits(recs[1].data))
    assert np.array_equal(bits(tail_of(s, "m1")), bits(recs[2].data))
    # Plain safetensors files: mx.load reads the same bits, the dtype in the header is true.
    loaded = mx.load(str(page_path(tmp_path, recs[0].hash)))
    assert loaded["kv"].dtype == dtype and np.array_equal(bits(loaded["kv"]), bits(recs[0].data))
    assert mx.load(str(tail_path(tmp_path, tail_hash(toks))))["kv"].dtype == dtype
    assert mx.load(str(entry_path(tmp_path, "m1"))) == {}  # the tail is in its own file


def test_entries_without_tail_and_empty(tmp_path, stores):
    s = stores(tmp_path)
    assert s.put("full", list(range(8)), records(list(range(8))))
    assert s.get("full").tail_tokens == 0 and tail_of(s, "full") is None
    assert s.put("empty", [], [])
    assert s.get("empty") == type(s.get("full"))("empty", (), [], 0, ((0, 0),), False)
    assert s.get("nope") is None and tail_of(s, "nope") is None
    assert page_of(s, b"\0" * 32) is None and not s.has_page(b"\0" * 32)
    assert sorted(s.keys()) == ["empty", "full"]


def test_inconsistent_records_are_value_errors(tmp_path, stores):
    s = stores(tmp_path)
    toks = list(range(10))
    good = records(toks)
    bad_hash = [PageRecord(b"\1" * 32, good[0].tokens, good[0].data), *good[1:]]
    short = [PageRecord(good[0].hash, good[0].tokens[:3], good[0].data[:, :, :, :3])]
    cases = [
        (toks, bad_hash),
        (toks[:3], short),
        (toks, good[:2]),  # tokens not covered
        (toks, [good[2], good[0], good[1]]),  # tail first
        (toks, [good[0], good[1], PageRecord(None, good[2].tokens, None)]),
        (toks, [good[0], PageRecord(good[1].hash, good[1].tokens, None), good[2]]),  # no data
        (toks, [good[0], good[1], PageRecord(None, good[2].tokens, good[1].data)]),  # shape
        (list(range(8)), [good[0], PageRecord(None, good[1].tokens, good[1].data)]),  # full tail
    ]
    for t, recs in cases:
        with pytest.raises(ValueError):
            s.put("k", t, recs)
    assert s.keys() == [] and data_files(tmp_path) == {}
    with pytest.raises(ValueError):
        stores(tmp_path / "x", dtype=mx.int32)


def test_a_second_store_on_the_same_root_is_refused(tmp_path, stores):
    s = stores(tmp_path)
    with pytest.raises(DiskStoreLockedError):
        DiskStore(tmp_path, **GEO, max_bytes=1 << 20)
    s.close()
    with stores(tmp_path) as s2:
        assert s2.keys() == []
    with pytest.raises(RuntimeError):
        s2.keys()


# -- sharing --------------------------------------------------------------------------------------


def test_shared_pages_are_stored_once(tmp_path, stores, monkeypatch):
    s = stores(tmp_path)
    a = list(range(12))  # 3 full pages
    b = list(range(8)) + [50, 51, 52, 53, 54, 55]  # 2 shared pages, 1 new, tail of 2
    assert s.put("a", a, records(a))
    page_size = page_path(tmp_path, hashes(a)[0]).stat().st_size
    writes = []
    real = afs.atomic_write_many
    monkeypatch.setattr(afs, "atomic_write_many", lambda files, done: (
        writes.extend(f[1] for f in files), real(files, done))[1])
    assert s.put("b", b, records(b))
    assert writes == [hashes(b)[2].hex() + ".safetensors", tail_hash(b).hex() + ".safetensors",
                      entry_name("b")]
    pages = [f for f in data_files(tmp_path) if f.startswith("pages/")]
    assert len(pages) == 4 and s.stats().pages == 4 and s.stats().tail_pages == 1
    man = entry_path(tmp_path, "a").stat().st_size + entry_path(tmp_path, "b").stat().st_size
    tail = tail_path(tmp_path, tail_hash(b)).stat().st_size
    assert s.stats().bytes_on_disk == 4 * page_size + man + tail
    check_accounting(s, tmp_path)
    # An entry whose pages are all on disk writes only its manifest, with or without data.
    writes.clear()
    assert s.put("a2", a, records(a, no_data=set(hashes(a))))
    assert s.put("a3", a[:9], records(a[:9]))
    assert writes == [entry_name("a2"), entry_name("a3")]
    assert s.stats().pages == 4


def test_twenty_turns_cost_about_the_final_turn(tmp_path, stores):
    geo = {**GEO, "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "page_size": 16}
    s = stores(tmp_path, **geo)
    rng = np.random.default_rng(7)
    toks: list[int] = []
    for turn in range(20):
        toks = toks + [int(t) for t in rng.integers(0, 50_000, size=int(rng.integers(13, 41)))]
        assert s.put(f"turn-{turn}", toks, records(toks, geo))
    per_token = 2 * 2 * 2 * 64 * 2
    final_kv = len(toks) * per_token
    assert s.stats().entries == 20 and s.stats().pages == len(toks) // 16
    assert s.stats().tail_pages == 1  # each turn's tail is continued by the next turn
    total = s.stats().bytes_on_disk
    assert total <= 1.2 * final_kv, (total, final_kv)
    check_accounting(s, tmp_path)
    for turn in (0, 9, 19):
        assert s.get(f"turn-{turn}").page_hashes == hashes(s.get(f"turn-{turn}").tokens, geo)


# -- files changed behind the store's back --------------------------------------------------------


def test_files_removed_behind_the_stores_back(tmp_path, stores):
    s = stores(tmp_path)
    a, b = list(range(9)), list(range(4)) + [60, 61, 62, 63, 64]
    assert s.put("a", a, records(a)) and s.put("b", b, records(b))
    entry_path(tmp_path, "a").unlink()
    assert s.load_entry("a") is None and s.get("a") is None and s.keys() == ["b"]
    assert not s.has_page(hashes(a)[1]) and s.has_page(hashes(a)[0])  # "b" holds page 0
    page_path(tmp_path, hashes(b)[1]).unlink()
    assert s.has_page(hashes(b)[1])  # the index does not know yet
    assert s.put("b2", b, records(b))  # the missing page is written again
    assert page_path(tmp_path, hashes(b)[1]).exists()
    os.unlink(page_path(tmp_path, hashes(b)[1]))
    assert page_of(s, hashes(b)[1]) is None and not s.has_page(hashes(b)[1])
    assert s.get("b").page_hashes == hashes(b)  # the caller reuses the prefix before the gap
    check_accounting(s, tmp_path)


def test_a_manifest_replaced_by_another_valid_one_of_its_key_is_indexed_again(tmp_path,
                                                                               stores):
    toks, other = list(range(9)), list(range(100, 113))
    a = stores(tmp_path / "a")
    assert a.put("k", toks, records(toks)) and a.put("j", other, records(other))
    with stores(tmp_path / "b") as b:
        assert b.put("k", other, records(other))
    os.replace(entry_path(tmp_path / "b", "k"), entry_path(tmp_path / "a", "k"))
    e = a.load_entry("k")
    assert e.entry.tokens == tuple(other) and a.get("k").tokens == tuple(other)
    assert a.load_entry("k").entry.page_hashes == hashes(other)  # and as indexed now
    check_accounting(a, tmp_path / "a")


# -- hostile keys and planted links ---------------------------------------------------------------


HOSTILE_KEYS = ["..", ".", "../x", "/etc/passwd", "a\\b", "x\x00y", "k" * 10_000, "a\u2215b",
                "a\uff0fb", "", " ", "entries/../../x", "\ud800", "C:\\x", "%2e%2e%2fx",
                "pages/ab", ".tmp.1.2.x"]


def test_hostile_keys_never_leave_the_root_and_round_trip(tmp_path, stores):
    root = tmp_path / "store"
    passwd = os.stat("/etc/passwd") if os.path.exists("/etc/passwd") else None
    s = stores(root)
    for i, key in enumerate(HOSTILE_KEYS):
        toks = [i, i + 1, i + 2, i + 3, i + 4]
        assert s.put(key, toks, records(toks))
    for i, key in enumerate(HOSTILE_KEYS):
        assert s.get(key).key == key and s.get(key).tokens == (i, i + 1, i + 2, i + 3, i + 4)
        assert tail_of(s, key) is not None
    assert sorted(os.listdir(tmp_path)) == ["store"]
    assert sorted(os.listdir(root)) == [".lock", "arrays", "entries", "pages", "tails"]
    check_accounting(s, root)
    assert len(os.listdir(root / "entries")) == len(HOSTILE_KEYS)
    s.close()
    s = stores(root)
    assert sorted(s.keys()) == sorted(HOSTILE_KEYS)
    assert all(s.get(k).key == k for k in HOSTILE_KEYS)
    if passwd is not None:
        assert os.stat("/etc/passwd").st_mtime_ns == passwd.st_mtime_ns


def test_planted_symlinks_are_not_followed(tmp_path, stores):
    root, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    s = stores(root)
    toks = list(range(9))
    assert s.put("k", toks, records(toks))
    h0, h1 = hashes(toks)
    # Valid copies outside the root, then links to them in place of our files.
    targets = {}
    for name, path in (("man", entry_path(root, "k")), ("page", page_path(root, h0))):
        targets[name] = outside / name
        targets[name].write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(targets[name])
    snap = {p: p.read_bytes() for p in targets.values()}
    assert page_of(s, h0) is None and s.load_entry("k") is None and s.get("k") is None
    assert not os.path.lexists(entry_path(root, "k"))
    assert not os.path.lexists(page_path(root, h0))
    assert {p: p.read_bytes() for p in targets.values()} == snap  # targets untouched
    s.close()
    # At start-up: a page directory that is a link to a directory outside.
    s = stores(root)
    assert s.put("k", toks, records(toks))
    sub = page_path(root, h1).parent
    ext = outside / "sub"
    os.replace(sub, ext)
    sub.symlink_to(ext, target_is_directory=True)
    entry_path(root, "z").symlink_to(targets["man"])
    s.close()
    ext_before = sorted(os.listdir(ext))
    s = stores(root)
    assert not s.has_page(h1) and not sub.is_symlink()
    assert not os.path.lexists(entry_path(root, "z"))
    assert sorted(os.listdir(ext)) == ext_before
    # A put through a directory link planted while running writes inside the root.
    assert s.put("k", toks, records(toks))
    assert page_path(root, h1).exists() and not page_path(root, h1).parent.is_symlink()
    assert sorted(os.listdir(ext)) == ext_before
    assert np.array_equal(bits(page_of(s, h1)), bits(records(toks)[1].data))
    check_accounting(s, root)


# -- write errors ---------------------------------------------------------------------------------


# A real read-only directory (chmod, with the capabilities that bypass file permissions dropped
# so it also holds as root) is checked end to end in
# tests/test_faults.py::test_real_read_only_dirs_for_an_unprivileged_process; the store's own
# handling of the errors is pinned below with injected PermissionError and ENOSPC.


@pytest.mark.parametrize("target, after, exc", [
    ("replace", 0, PermissionError(errno.EACCES, "read-only")),
    ("replace", 1, PermissionError(errno.EACCES, "read-only")),  # one page written
    ("replace", 2, PermissionError(errno.EACCES, "read-only")),  # pages written, manifest not
    ("write", 0, OSError(errno.ENOSPC, "No space left on device")),
    ("write", 2, OSError(errno.ENOSPC, "No space left on device")),
    ("fsync", 0, OSError(errno.EIO, "I/O error")),
    ("open", 0, PermissionError(errno.EROFS, "read-only file system")),
])
def test_write_errors_refuse_the_put_and_leave_nothing(tmp_path, stores, monkeypatch, target,
                                                       after, exc):
    s = stores(tmp_path)
    toks = list(range(6))
    assert s.put("k", toks, records(toks))
    before = tree(tmp_path)
    t2 = list(range(4)) + list(range(50, 60))  # shares a page with "k", 2 new pages, a tail
    if target == "open":  # only writes fail: temp files are created with O_EXCL
        real = os.open
        monkeypatch.setattr(os, "open", lambda p, flags, *a, **k: (_ for _ in ()).throw(exc)
                            if flags & os.O_EXCL else real(p, flags, *a, **k))
    else:
        monkeypatch.setattr(os, target, failing(after, exc, getattr(os, target)))
    assert not s.put("k2", t2, records(t2))
    monkeypatch.undo()
    assert s.stats().errors == 1
    assert tree(tmp_path) == before  # no temp files, no half-written entry, no stray pages
    assert s.keys() == ["k"] and s.get("k").tokens == tuple(toks)
    assert page_of(s, hashes(toks)[0]) is not None and tail_of(s, "k") is not None
    check_accounting(s, tmp_path)
    assert s.put("k2", t2, records(t2))  # usable again
    check_accounting(s, tmp_path)


def test_unremovable_files_refuse_the_put(tmp_path, stores, monkeypatch):
    size = entry_bytes(tmp_path, stores)
    root = tmp_path / "s"
    s = stores(root, max_bytes=size)
    assert s.put("a", conv(0), records(conv(0)))
    before = tree(root)
    monkeypatch.setattr(os, "unlink", failing(0, PermissionError(errno.EACCES, "no"), os.unlink))
    assert not s.put("b", conv(1), records(conv(1)))
    monkeypatch.undo()
    assert tree(root) == before and s.keys() == ["a"] and s.stats().errors == 1
    check_accounting(s, root)
    assert s.put("b", conv(1), records(conv(1)))  # "a" is still a candidate, and goes now
    assert s.keys() == ["b"] and s.stats().evictions == 1
    check_accounting(s, root)
