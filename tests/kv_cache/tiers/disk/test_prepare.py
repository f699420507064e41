"""What a put writes (``prepare``): one chat stored once. An entry's open tail page is held by
the stored file that continues it (a full page, else the longest tail file), written only when
none does; a longer file replaces a shorter tail file, and its entries move to it."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.tiers.base import PageRecord
from kv_cache.tiers.disk import atomic_fs as afs
from kv_cache.tiers.disk.index import entry_name
from tests.kv_cache.tiers.disk.disk_helpers import (
    GEO, bits, check_accounting, data_files, fresh, hashes, header_of, kv, records, tail_files,
    tail_hash, tail_of, tail_path, turn_records, write_with_header,
)


@pytest.mark.parametrize("answer_len", [11, 12, 14], ids=["same-page", "fills-it", "next-page"])
@pytest.mark.parametrize("answer_first", [False, True])
def test_a_turns_prompt_and_answer_store_their_tail_page_once(tmp_path, stores, monkeypatch,
                                                             answer_len, answer_first):
    """The prompt's entry ends inside a page that the answer's entry continues (in its tail or
    in a full page): the page's bytes are on disk once, each entry reads its own length."""
    s = stores(tmp_path)
    toks = list(range(200, 200 + answer_len))
    data = kv(b"one sequence", answer_len)
    prompt, answer = toks[:9], toks  # the prompt: 2 pages and a tail of 1
    writes = []
    real = afs.atomic_write_many
    monkeypatch.setattr(afs, "atomic_write_many", lambda files, done: (
        writes.extend(f[1] for f in files), real(files, done))[1])
    order = [("a", answer), ("p", prompt)] if answer_first else [("p", prompt), ("a", answer)]
    for key, t in order:
        assert s.put(key, t, turn_records(t, data))
    if answer_first:  # the prompt's tail is held by what the answer stored: only its manifest
        pages, tail = answer_len // 4, int(answer_len % 4 > 0)
        assert writes[-1:] == [entry_name("p")] and len(writes) == pages + tail + 2
    # One file holds every tail: the answer's tail file, if it has a tail, and nothing else.
    want = [f"tails/{tail_hash(answer).hex()[:2]}/{tail_hash(answer).hex()}.safetensors"] \
        if answer_len % 4 else []
    assert tail_files(tmp_path) == want and s.stats().tail_pages == len(want)
    check_accounting(s, tmp_path)

    def check(store):
        for key, t in (("p", prompt), ("a", answer)):
            n = len(t) % 4
            tail = tail_of(store, key)
            if n:
                assert np.array_equal(bits(tail), bits(data[:, :, :, len(t) - n : len(t), :]))
            else:
                assert tail is None
            assert store.load_entry(key).entry.tokens == tuple(t)

    check(s)
    s.close()
    s = stores(tmp_path)  # after a restart: the same files, the same answers
    assert tail_files(tmp_path) == want
    check(s)
    check_accounting(s, tmp_path)
    # Deleting the answer keeps the prompt whole: the file holding its tail stays.
    assert s.delete("a")
    tail = tail_of(s, "p")
    assert np.array_equal(bits(tail), bits(data[:, :, :, 8:9, :]))
    assert len(data_files(tmp_path)) == 2 + 1 + 1  # 2 pages + the page or tail holding it
    check_accounting(s, tmp_path)
    assert s.delete("p") and data_files(tmp_path) == {}


def test_an_entry_whose_tail_another_holds_writes_no_tail(tmp_path, stores):
    s = stores(tmp_path)
    toks = list(range(10))
    data = kv(b"seq", 10)
    assert s.put("long", toks, turn_records(toks, data))
    (t,) = tail_files(tmp_path)
    before = data_files(tmp_path)[t]
    assert s.put("short", toks[:9], turn_records(toks[:9], data))  # its tail: a prefix of long's
    assert tail_files(tmp_path) == [t] and data_files(tmp_path)[t] == before
    assert np.array_equal(bits(tail_of(s, "short")), bits(data[:, :, :, 8:9, :]))
    # A longer tail replaces the shorter file; both entries move to it.
    toks2 = toks + [10]
    data2 = mx.concatenate([data, kv(b"more", 1)], axis=3)
    assert s.put("longer", toks2, turn_records(toks2, data2))
    assert tail_files(tmp_path) == [f"tails/{tail_hash(toks2).hex()[:2]}/"
                                    f"{tail_hash(toks2).hex()}.safetensors"]
    for key, n in (("short", 9), ("long", 10), ("longer", 11)):
        assert np.array_equal(bits(tail_of(s, key)), bits(data2[:, :, :, 8:n, :])), key
    check_accounting(s, tmp_path)
    # Evicting the entry that wrote the tail file leaves it to those that still use it.
    assert s.delete("longer") and s.delete("long")
    assert np.array_equal(bits(tail_of(s, "short")), bits(data[:, :, :, 8:9, :]))
    check_accounting(s, tmp_path)
    assert s.delete("short") and data_files(tmp_path) == {}


def test_a_tail_of_another_branch_is_not_shared(tmp_path, stores):
    s = stores(tmp_path)
    a, b = list(range(10)), list(range(9)) + [99]  # same parent, tails [8, 9] and [8, 99]
    assert s.put("a", a, records(a)) and s.put("b", b, records(b))
    assert len(tail_files(tmp_path)) == 2
    assert np.array_equal(bits(tail_of(s, "a")), bits(records(a)[-1].data))
    assert np.array_equal(bits(tail_of(s, "b")), bits(records(b)[-1].data))
    check_accounting(s, tmp_path)


def test_the_budget_counts_a_shared_tail_once(tmp_path, stores):
    toks = list(range(11))
    data = kv(b"seq", 11)
    with stores(tmp_path / "probe") as p:
        assert p.put("a", toks, turn_records(toks, data))
        one = p.stats().bytes_on_disk
        assert p.put("p", toks[:9], turn_records(toks[:9], data))
        both = p.stats().bytes_on_disk
    man = both - one  # the second entry adds its manifest only
    s = stores(tmp_path / "s", max_bytes=both)
    assert s.put("p", toks[:9], turn_records(toks[:9], data))
    assert s.put("a", toks, turn_records(toks, data))  # fits: the prompt's tail file goes
    assert sorted(s.keys()) == ["a", "p"] and s.stats().evictions == 0
    assert s.stats().bytes_on_disk == both and man < 1000
    check_accounting(s, tmp_path / "s")


@pytest.mark.parametrize("damage", ["truncate", "flip", "other-name", "symlink", "foreign"])
def test_a_bad_tail_file_is_a_miss_and_removed(tmp_path, stores, damage):
    for live in (False, True):
        root = fresh(tmp_path / "r")
        s = stores(root)
        toks = list(range(10))
        assert s.put("k", toks, records(toks))
        (t,) = tail_files(root)
        path = root / t
        raw = path.read_bytes()
        if not live:
            s.close()
        if damage == "truncate":
            path.write_bytes(raw[: len(raw) - 5])
        elif damage == "flip":
            bad = bytearray(raw)
            bad[-3] ^= 0x10
            path.write_bytes(bytes(bad))
        elif damage == "other-name":  # a valid tail file of another tail, under this name
            other = list(range(9)) + [77]
            with stores(tmp_path / "other") as o:
                assert o.put("k", other, records(other))
                path.write_bytes(tail_path(tmp_path / "other", tail_hash(other)).read_bytes())
        elif damage == "symlink":
            (tmp_path / "outside").write_bytes(raw)
            path.unlink()
            path.symlink_to(tmp_path / "outside")
        else:  # another format version
            header, body = header_of(path)
            header["__metadata__"]["format_version"] = "3"
            write_with_header(path, header, body)
        if not live:
            s = stores(root)
        assert s.get("k").tokens == tuple(toks)  # the entry's pages are fine
        assert tail_of(s, "k") is None  # its tail is a miss, never a crash
        assert not os.path.lexists(path)
        loaded = s.load_entry("k")
        assert loaded is not None and loaded.tails == {}
        check_accounting(s, root)
        s.close()
        if damage == "symlink":
            assert (tmp_path / "outside").read_bytes() == raw


def test_twenty_turns_of_prompts_and_answers_cost_the_final_turn(tmp_path, stores):
    """Each turn saves the prompt's entry and the answer's entry, as the server does: the tails
    of all of them are held by the last turn's pages and one tail file."""
    geo = {**GEO, "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "page_size": 16}
    s = stores(tmp_path, **geo)
    rng = np.random.default_rng(3)
    toks: list[int] = []
    P = 16
    for turn in range(20):
        toks = toks + [int(t) for t in rng.integers(0, 50_000, size=int(rng.integers(13, 41)))]
        prompt = len(toks)
        toks = toks + [int(t) for t in rng.integers(0, 50_000, size=24)]
        data = kv(b"conversation", len(toks), geo)  # NOTE: the same bits for the same positions
        for key, n in ((f"u{turn}", prompt), (f"a{turn}", len(toks))):
            t = toks[:n]
            recs = [PageRecord(h, tuple(t[i * P : (i + 1) * P]),
                               data[:, :, :, i * P : (i + 1) * P, :])
                    for i, h in enumerate(hashes(t, geo))]
            tails = {0: data[:, :, :, n - n % P : n, :]} if n % P else None
            assert s.put(key, t, recs, tails=tails)
    final_kv = len(toks) * 2 * 2 * 2 * 64 * 2
    assert s.stats().tail_pages <= 1
    manifests = sum(v for k, v in data_files(tmp_path).items() if k.startswith("entries/"))
    assert s.stats().pages == len(toks) // P  # each page once, headers included:
    assert s.stats().bytes_on_disk - manifests <= 1.06 * final_kv
    check_accounting(s, tmp_path)
