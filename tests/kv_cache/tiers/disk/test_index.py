"""The store's index and accounting (``index``): the byte budget and its eviction order, pages
that other entries hold kept, pins, and every invariant under random operations."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_cache.pages.hashing import root_hash
from kv_cache.tiers.disk.store import DiskStore
from tests.kv_cache.tiers.disk.disk_helpers import (
    FP, GEO, bits, check_accounting, conv, data_files, entry_bytes, entry_path, hashes, header_of,
    page_of, page_path, records, tree,
)


def test_budget_evicts_least_recently_used_first(tmp_path, stores):
    size = entry_bytes(tmp_path, stores)
    root = tmp_path / "s"
    s = stores(root, max_bytes=3 * size)
    for i, k in enumerate("abc"):
        assert s.put(k, conv(i), records(conv(i)))
        check_accounting(s, root)
    assert s.stats().bytes_on_disk == 3 * size
    assert s.put("d", conv(3), records(conv(3)))
    assert s.keys() == ["b", "c", "d"] and s.stats().evictions == 1
    assert not any(s.has_page(h) for h in hashes(conv(0)))
    check_accounting(s, root)
    s.touch("b")
    assert s.put("e", conv(4), records(conv(4)))
    assert s.keys() == ["d", "b", "e"]
    assert s.put("f", conv(5), records(conv(5)), pinned={"d", "b"})
    assert s.keys() == ["d", "b", "f"]
    check_accounting(s, root)
    before = tree(root)
    assert not s.put("g", conv(6), records(conv(6)), pinned=["d", "b", "f"])  # cannot fit
    assert tree(root) == before and s.keys() == ["d", "b", "f"]
    assert s.stats().refused == 1 and s.stats().evictions == 3
    # Bigger than the whole budget: refused, nothing evicted, nothing written.
    big = list(range(4 * 8))
    assert not s.put("huge", big, records(big))
    assert tree(root) == before
    # Replacing an entry: its old pages that nothing else holds go with the old manifest.
    assert s.put("d", conv(7), records(conv(7)))
    assert not any(s.has_page(h) for h in hashes(conv(3)))
    assert s.keys() == ["b", "f", "d"] and s.stats().evictions == 3
    check_accounting(s, root)
    s.close()
    s = stores(root, max_bytes=3 * size)
    assert s.keys() == ["b", "f", "d"]
    assert s.put("h", conv(8), records(conv(8)))
    assert s.keys() == ["f", "d", "h"]


def test_eviction_keeps_pages_that_other_entries_hold(tmp_path, stores):
    x, y = list(range(8)), list(range(12))  # y continues x: x's 2 pages are y's first 2
    z = list(range(100, 108))
    s = stores(tmp_path / "m")
    for k, t in (("x", x), ("y", y), ("z", z)):
        assert s.put(k, t, records(t))
    need = s.stats().bytes_on_disk - entry_path(tmp_path / "m", "x").stat().st_size
    s.close()
    root = tmp_path / "s"
    s = stores(root, max_bytes=need)
    assert s.put("x", x, records(x)) and s.put("y", y, records(y))
    assert s.put("z", z, records(z))
    assert s.keys() == ["y", "z"] and s.stats().evictions == 1
    assert all(s.has_page(h) for h in hashes(y))  # x's pages stay: y holds them
    assert np.array_equal(bits(page_of(s, hashes(x)[0])), bits(records(x)[0].data))
    check_accounting(s, root)
    assert s.delete("y") and not s.delete("y")
    assert not any(s.has_page(h) for h in hashes(y)) and s.keys() == ["z"]
    check_accounting(s, root)


def test_a_put_reuses_pages_that_eviction_would_free(tmp_path, stores):
    size = entry_bytes(tmp_path, stores)
    root = tmp_path / "s"
    s = stores(root, max_bytes=size + 10)
    assert s.put("a", conv(0), records(conv(0)))
    # "b" has the same pages as "a": evicting "a" must not delete them ("b" needs them).
    assert s.put("b", conv(0), records(conv(0), no_data=set(hashes(conv(0)))))
    assert s.keys() == ["b"] and all(s.has_page(h) for h in hashes(conv(0)))
    assert page_of(s, hashes(conv(0))[1]) is not None
    check_accounting(s, root)


def test_s3fifo_policy_keeps_the_budget_and_pins(tmp_path, stores):
    size = entry_bytes(tmp_path, stores)
    root = tmp_path / "s"
    s = stores(root, max_bytes=3 * size, policy="s3fifo")
    assert s.stats().policy == "s3fifo"
    for i in range(12):
        s.touch("k0")
        assert s.put(f"k{i}", conv(i), records(conv(i)), pinned={"k0"})
        check_accounting(s, root)
        assert "k0" in s.keys() and len(s.keys()) <= 3
    with pytest.raises(ValueError):
        stores(tmp_path / "x", policy="nope")


# -- properties -----------------------------------------------------------------------------------


BRANCHES = [list(range(6)), list(range(10)), list(range(13)), list(range(8)) + [90, 91, 92],
            [5, 6, 7, 8, 9], list(range(4)) + [70] * 9]


def holds_tail(path: Path, e) -> bool:
    """Whether the full page file at ``path`` continues entry ``e``'s open tail page."""
    meta = header_of(path)[0]["__metadata__"]
    last = e.page_hashes[-1] if e.page_hashes else root_hash(FP)
    n = e.tail_tokens
    return bool(n) and meta["parent"] == last.hex() \
        and json.loads(meta["tokens"])[:n] == list(e.tokens[-n:])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "put", "put", "touch", "delete",
                                               "restart"]),
                              st.sampled_from("abcde"), st.integers(0, len(BRANCHES) - 1),
                              st.sets(st.sampled_from("abcde"), max_size=2)),
                    min_size=1, max_size=25),
       budget_pages=st.integers(0, 12))
def test_random_operations_keep_every_invariant(ops, budget_pages):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        page_file = 2 * 2 * 2 * 4 * 4 * 2 + 700
        kw = {**GEO, "max_bytes": budget_pages * page_file}
        s = DiskStore(root, **kw)
        model: dict[str, list[int]] = {}
        try:
            for op, key, branch, pinned in ops:
                toks = BRANCHES[branch]
                if op == "put":
                    was = set(s.keys())
                    if s.put(key, toks, records(toks), pinned=pinned):
                        model[key] = toks
                        assert key in s.keys() and s.keys()[-1] == key
                        assert (was & set(pinned)) <= set(s.keys())
                    else:
                        assert set(s.keys()) == was
                elif op == "touch":
                    s.touch(key)
                elif op == "delete":
                    s.delete(key)
                    model.pop(key, None)
                else:
                    order = s.keys()
                    s.close()
                    s = DiskStore(root, **kw)
                    assert s.keys() == order
                check_accounting(s, root)
                assert set(s.keys()) <= set(model)
                held, entries = set(), [s.get(k) for k in s.keys()]
                for k, e in zip(s.keys(), entries):
                    assert list(e.tokens) == model[k]
                    assert all(s.has_page(h) for h in e.page_hashes)
                    held |= set(e.page_hashes)
                pages = {bytes.fromhex(Path(f).stem) for f in data_files(root)
                         if f.startswith("pages/")}
                assert s.stats().pages == len(pages) and held <= pages
                for h in pages - held:  # no orphan pages: the rest hold an entry's open tail
                    assert any(holds_tail(page_path(root, h), e) for e in entries), h.hex()
            for k in s.keys():
                for h in s.get(k).page_hashes:
                    assert page_of(s, h) is not None
        finally:
            s.close()
