"""The disk store's keyed arrays (kv_cache/tiers/disk/arrays.py): bit for bit as written, every
dtype kept; counted in the budget and evicted oldest first with the entries (recency kept over
a restart); a bad, foreign or misnamed file is a miss and is removed; a key never becomes a
path."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.tiers.disk.arrays import host_arrays
from kv_cache.tiers.disk.index import entry_name
from tests.kv_cache.tiers.disk.disk_helpers import GEO, data_files, records

DTYPES = (mx.float16, mx.bfloat16, mx.float32, mx.int32, mx.uint32, mx.int64, mx.uint8,
          mx.bool_)


def arrays(seed: int, rows: int = 6) -> dict[str, mx.array]:
    """Random bit patterns (NaNs and subnormals included) of every dtype a file keeps."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, dt in enumerate(DTYPES):
        raw = rng.integers(0, 1 << 16, size=(rows, 3), dtype=np.uint16)
        a = mx.array(raw).view(dt) if dt.size == 2 else mx.array(raw.astype(np.int64)).astype(dt)
        out[f"a{i}"] = a
    out["scalar"] = mx.array(3.5, dtype=mx.float32)
    return out


def bit_equal(a: dict[str, mx.array], b: dict[str, mx.array]) -> bool:
    def raw(x: mx.array) -> np.ndarray:
        return np.asarray(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)

    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and raw(a[k]).tobytes() == raw(b[k]).tobytes() for k in a)


def arrays_files(root: Path) -> dict[str, int]:
    return {k: v for k, v in data_files(root).items() if k.startswith("arrays/")}


def test_what_is_read_back_is_bit_for_bit_what_was_put(tmp_path, stores):
    s = stores(tmp_path)
    kept = arrays(1)
    assert not s.has_arrays("image:x") and s.load_arrays("image:x") is None
    assert s.put_arrays("image:x", host_arrays(kept))
    assert s.has_arrays("image:x")
    assert bit_equal(s.load_arrays("image:x"), kept)
    # the file is named for the key's hash, never the key
    assert list(arrays_files(tmp_path)) == [f"arrays/{entry_name('image:x')}"]
    st = s.stats()
    assert st.arrays == 1 and st.arrays_bytes == sum(arrays_files(tmp_path).values())
    assert st.bytes_on_disk == sum(data_files(tmp_path).values())
    s.close()
    s2 = stores(tmp_path)  # a restart: found by the scan, read back the same
    assert s2.has_arrays("image:x") and bit_equal(s2.load_arrays("image:x"), kept)


def test_a_key_that_looks_like_a_path_stays_a_name(tmp_path, stores):
    s = stores(tmp_path)
    key = "../../etc/passwd"
    assert s.put_arrays(key, host_arrays(arrays(2)))
    assert bit_equal(s.load_arrays(key), arrays(2))
    assert all(f.startswith("arrays/") and "passwd" not in f for f in arrays_files(tmp_path))


def test_arrays_and_entries_are_evicted_oldest_first_within_the_budget(tmp_path, stores):
    s = stores(tmp_path / "probe")
    s.put_arrays("k", host_arrays(arrays(0, rows=200)))
    size = s.stats().arrays_bytes  # one arrays file (each of these shapes takes as much)
    s.put("e0", list(range(8)), records(list(range(8))))
    entry = s.stats().bytes_on_disk - size
    s.close()
    assert size > entry > 0
    budget = 3 * size + entry - 1  # two arrays files and the entry fit; three and it do not
    s = stores(tmp_path / "kv", max_bytes=budget)
    assert s.put_arrays("k0", host_arrays(arrays(0, rows=200)))
    assert s.put("e0", list(range(8)), records(list(range(8))))
    assert s.put_arrays("k1", host_arrays(arrays(1, rows=200)))
    assert s.load_arrays("k0") is not None  # k0 used again: e0 is now the oldest
    assert s.put_arrays("k2", host_arrays(arrays(2, rows=200)))  # something goes: e0
    assert s.keys() == [] and all(s.has_arrays(k) for k in ("k0", "k1", "k2"))
    assert s.put_arrays("k3", host_arrays(arrays(3, rows=200)))  # then k1, the oldest
    assert [k for k in ("k0", "k1", "k2", "k3") if s.has_arrays(k)] == ["k0", "k2", "k3"]
    st = s.stats()
    assert st.evictions == 2 and st.arrays == 3
    assert st.bytes_on_disk == sum(data_files(tmp_path / "kv").values()) <= budget
    s.close()
    # the recency survives a restart (the files' mtimes): a smaller budget keeps the newest
    s = stores(tmp_path / "kv", max_bytes=2 * size + size // 2)
    assert [k for k in ("k0", "k1", "k2", "k3") if s.has_arrays(k)] == ["k2", "k3"]
    assert s.stats().bytes_on_disk == sum(data_files(tmp_path / "kv").values())


def test_arrays_larger_than_the_budget_are_refused(tmp_path, stores):
    s = stores(tmp_path, max_bytes=64)
    assert not s.put_arrays("k", host_arrays(arrays(0)))
    assert s.stats().refused == 1 and not s.has_arrays("k") and arrays_files(tmp_path) == {}


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "renamed"])
def test_a_bad_file_is_a_miss_and_is_removed(tmp_path, stores, damage):
    s = stores(tmp_path)
    assert s.put_arrays("k", host_arrays(arrays(0)))
    path = tmp_path / "arrays" / entry_name("k")
    if damage == "flip":
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0x40
        path.write_bytes(bytes(raw))
        assert s.load_arrays("k") is None
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-5])
        assert s.load_arrays("k") is None
    else:
        s.close()
        if damage == "renamed":  # another key's file under this key's name
            os.replace(path, tmp_path / "arrays" / entry_name("other"))
        else:  # a file of another model
            other = stores(tmp_path / "other", **{**GEO, "fingerprint": "model-b"})
            other.put_arrays("k", host_arrays(arrays(0)))
            other.close()
            os.replace(tmp_path / "other" / "arrays" / entry_name("k"), path)
        s = stores(tmp_path)
        assert not s.has_arrays("k") and not s.has_arrays("other")
    assert not s.has_arrays("k") and arrays_files(tmp_path) == {}
    assert s.stats().bytes_on_disk == sum(data_files(tmp_path).values())
