"""DiskStore: exact round trips, deduplication, restart from headers, every corruption a miss,
hostile keys and files, the byte budget and its eviction order, write errors."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_cache.tiers.disk import file_format as fmt
from kv_cache.tiers.disk import atomic_fs as afs
from kv_cache.tiers.disk.store import DiskStore, DiskStoreLockedError, PageRecord, entry_name
from kv_cache.pages.hashing import page_hash, root_hash

FP = "model-a"
GEO = dict(fingerprint=FP, num_layers=2, num_kv_heads=2, head_dim=4, page_size=4,
           dtype=mx.float16)
BITS = {mx.float16: (np.uint16, mx.uint16), mx.bfloat16: (np.uint16, mx.uint16),
        mx.float32: (np.uint32, mx.uint32)}
FILE_RE = re.compile(r"(entries/[0-9a-f]{64}|(pages|tails)/([0-9a-f]{2})/\3[0-9a-f]{62})"
                     r"\.safetensors")


@pytest.fixture
def stores():
    """Opens stores and closes every one at the end (a root is locked while a store has it)."""
    opened = []

    def make(root, **over):
        kw = {**GEO, "max_bytes": 1 << 30, **over}
        s = DiskStore(root, **kw)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


def kv(seed: bytes, n: int, geo=GEO) -> mx.array:
    """Random bit patterns (NaNs, infinities and subnormals included) of a page's shape."""
    np_bits, mx_bits = BITS[geo["dtype"]]
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed).digest()[:8], "little"))
    shape = (geo["num_layers"], 2, geo["num_kv_heads"], n, geo["head_dim"])
    raw = rng.integers(0, np.iinfo(np_bits).max, size=shape, dtype=np_bits, endpoint=True)
    return mx.array(raw).view(geo["dtype"])


def bits(a: mx.array) -> np.ndarray:
    return np.asarray(a.view(BITS[a.dtype][1]))


def records(tokens, geo=GEO, no_data=()) -> list[PageRecord]:
    """The pages of ``tokens``: sealed full pages (data a function of the hash), then a tail."""
    P, parent, out = geo["page_size"], root_hash(geo["fingerprint"]), []
    for i in range(len(tokens) // P):
        chunk = tuple(tokens[i * P : (i + 1) * P])
        parent = page_hash(parent, chunk)
        out.append(PageRecord(parent, chunk, None if parent in no_data else kv(parent, P, geo)))
    rest = tuple(tokens[len(out) * P :])
    if rest:
        out.append(PageRecord(None, rest, kv(parent + repr(rest).encode(), len(rest), geo)))
    return out


def hashes(tokens, geo=GEO) -> list[bytes]:
    return fmt.chain_hashes(root_hash(geo["fingerprint"]), tokens, geo["page_size"])


def tree(root: Path) -> dict[str, int]:
    """Every file under ``root`` (symlinks not followed) -> size."""
    out = {}
    for d, dirs, files in os.walk(root):
        for f in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = os.lstat(p).st_size
    return out


def data_files(root: Path) -> dict[str, int]:
    return {k: v for k, v in tree(root).items() if k != ".lock"}


def page_path(root: Path, h: bytes) -> Path:
    return root / "pages" / h.hex()[:2] / (h.hex() + ".safetensors")


def tail_path(root: Path, h: bytes) -> Path:
    return root / "tails" / h.hex()[:2] / (h.hex() + ".safetensors")


def tail_hash(tokens, geo=GEO) -> bytes:
    """The name of the tail file that holds the open tail page of ``tokens``."""
    P = geo["page_size"]
    full = hashes(tokens, geo)
    return page_hash(full[-1] if full else root_hash(geo["fingerprint"]),
                     tuple(tokens[len(full) * P :]))


def entry_path(root: Path, key: str) -> Path:
    return root / "entries" / entry_name(key)


def header_of(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_with_header(path: Path, header: dict, data: bytes, reseal=True) -> None:
    if reseal and isinstance(header.get("__metadata__"), dict):
        fmt.seal_metadata(header["__metadata__"])
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def check_accounting(store: DiskStore, root: Path) -> None:
    files = data_files(root)
    assert not [f for f in files if not FILE_RE.fullmatch(f)], files
    assert store.stats()["bytes_on_disk"] == sum(files.values())
    assert store.stats()["bytes_on_disk"] <= store.max_bytes


# -- round trips -----------------------------------------------------------------------------------


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
        got = s.load_page(r.hash)
        assert got.dtype == dtype and got.shape == r.data.shape
        assert np.array_equal(bits(got), bits(r.data))
    tail = s.load_tail("m1")
    assert tail.dtype == dtype and np.array_equal(bits(tail), bits(recs[2].data))
    s.close()
    s = stores(tmp_path, dtype=dtype)  # and again after a restart
    assert np.array_equal(bits(s.load_page(recs[1].hash)), bits(recs[1].data))
    assert np.array_equal(bits(s.load_tail("m1")), bits(recs[2].data))
    # Plain safetensors files: mx.load reads the same bits, the dtype in the header is true.
    loaded = mx.load(str(page_path(tmp_path, recs[0].hash)))
    assert loaded["kv"].dtype == dtype and np.array_equal(bits(loaded["kv"]), bits(recs[0].data))
    assert mx.load(str(tail_path(tmp_path, tail_hash(toks))))["kv"].dtype == dtype
    assert mx.load(str(entry_path(tmp_path, "m1"))) == {}  # the tail is in its own file


def test_files_are_self_describing_safetensors(tmp_path, stores):
    from safetensors import safe_open

    s = stores(tmp_path)
    toks = list(range(6))
    recs = records(toks)
    assert s.put("msg-1", toks, recs)
    with safe_open(str(page_path(tmp_path, recs[0].hash)), framework="numpy") as f:
        meta = f.metadata()
        assert list(f.keys()) == ["kv"] and f.get_tensor("kv").dtype == np.float16
    assert {k: meta[k] for k in ("format", "format_version", "fingerprint", "page_size",
                                 "group")} == {
        "format": "mlx-kvcache-page", "format_version": "4", "fingerprint": FP,
        "page_size": "4", "group": "0"}
    assert json.loads(meta["cache_spec"]) == {
        "num_slots": 2, "states": [],
        "groups": [{"kind": "full", "layers": [0, 1], "num_kv_heads": 2, "head_dim": 4,
                    "dtype": "float16", "window": 0}]}
    assert json.loads(meta["tokens"]) == [0, 1, 2, 3]
    assert meta["hash"] == recs[0].hash.hex() and meta["parent"] == root_hash(FP).hex()
    assert meta["data_checksum"].startswith("xxh3-128:")
    assert meta["meta_checksum"] == fmt.meta_checksum(meta)
    with safe_open(str(tail_path(tmp_path, tail_hash(toks))), framework="numpy") as f:
        tmeta = f.metadata()
        assert f.get_tensor("kv").shape == (2, 2, 2, 2, 4)
    assert tmeta["format"] == "mlx-kvcache-tail" and json.loads(tmeta["tokens"]) == [4, 5]
    assert tmeta["parent"] == recs[0].hash.hex() and tmeta["format_version"] == "4"
    with safe_open(str(entry_path(tmp_path, "msg-1")), framework="numpy") as f:
        meta = f.metadata()
        assert list(f.keys()) == []
    assert meta["format"] == "mlx-kvcache-entry" and meta["key"] == "msg-1"
    assert json.loads(meta["tokens"]) == toks and meta["tail_tokens"] == "2"
    assert json.loads(meta["page_hashes"]) == [recs[0].hash.hex()]
    assert json.loads(meta["layout"]) == [[0, 1]] and meta["state"] == "0"


def test_entries_without_tail_and_empty(tmp_path, stores):
    s = stores(tmp_path)
    assert s.put("full", list(range(8)), records(list(range(8))))
    assert s.get("full").tail_tokens == 0 and s.load_tail("full") is None
    assert s.put("empty", [], [])
    assert s.get("empty") == type(s.get("full"))("empty", (), [], 0, ((0, 0),), False)
    assert s.get("nope") is None and s.load_tail("nope") is None
    assert s.load_page(b"\0" * 32) is None and not s.has_page(b"\0" * 32)
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


# -- sharing ---------------------------------------------------------------------------------------


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
    assert len(pages) == 4 and s.stats()["pages"] == 4 and s.stats()["tail_pages"] == 1
    man = entry_path(tmp_path, "a").stat().st_size + entry_path(tmp_path, "b").stat().st_size
    tail = tail_path(tmp_path, tail_hash(b)).stat().st_size
    assert s.stats()["bytes_on_disk"] == 4 * page_size + man + tail
    check_accounting(s, tmp_path)
    # An entry whose pages are all on disk writes only its manifest, with or without data.
    writes.clear()
    assert s.put("a2", a, records(a, no_data=set(hashes(a))))
    assert s.put("a3", a[:9], records(a[:9]))
    assert writes == [entry_name("a2"), entry_name("a3")]
    assert s.stats()["pages"] == 4


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
    assert s.stats()["entries"] == 20 and s.stats()["pages"] == len(toks) // 16
    assert s.stats()["tail_pages"] == 1  # each turn's tail is continued by the next turn
    total = s.stats()["bytes_on_disk"]
    assert total <= 1.2 * final_kv, (total, final_kv)
    check_accounting(s, tmp_path)
    for turn in (0, 9, 19):
        assert s.get(f"turn-{turn}").page_hashes == hashes(s.get(f"turn-{turn}").tokens, geo)


# -- one chat stored once: shared open tail pages --------------------------------------------------


def turn_records(tokens, data: mx.array) -> list[PageRecord]:
    """The pages of ``tokens`` cut from one sequence's KV ``data`` (as a pool holds them: the
    prompt's tail is a prefix of the answer's page)."""
    P, out = GEO["page_size"], []
    for i, h in enumerate(hashes(tokens)):
        out.append(PageRecord(h, tuple(tokens[i * P : (i + 1) * P]),
                              data[:, :, :, i * P : (i + 1) * P, :]))
    if len(tokens) % P:
        n = len(out) * P
        out.append(PageRecord(None, tuple(tokens[n:]), data[:, :, :, n : len(tokens), :]))
    return out


def tail_files(root: Path) -> list[str]:
    return sorted(f for f in data_files(root) if f.startswith("tails/"))


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
    assert tail_files(tmp_path) == want and s.stats()["tail_pages"] == len(want)
    check_accounting(s, tmp_path)

    def check(store):
        for key, t in (("p", prompt), ("a", answer)):
            n = len(t) % 4
            tail = store.load_tail(key)
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
    tail = s.load_tail("p")
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
    assert np.array_equal(bits(s.load_tail("short")), bits(data[:, :, :, 8:9, :]))
    # A longer tail replaces the shorter file; both entries move to it.
    toks2 = toks + [10]
    data2 = mx.concatenate([data, kv(b"more", 1)], axis=3)
    assert s.put("longer", toks2, turn_records(toks2, data2))
    assert tail_files(tmp_path) == [f"tails/{tail_hash(toks2).hex()[:2]}/"
                                    f"{tail_hash(toks2).hex()}.safetensors"]
    for key, n in (("short", 9), ("long", 10), ("longer", 11)):
        assert np.array_equal(bits(s.load_tail(key)), bits(data2[:, :, :, 8:n, :])), key
    check_accounting(s, tmp_path)
    # Evicting the entry that wrote the tail file leaves it to those that still use it.
    assert s.delete("longer") and s.delete("long")
    assert np.array_equal(bits(s.load_tail("short")), bits(data[:, :, :, 8:9, :]))
    check_accounting(s, tmp_path)
    assert s.delete("short") and data_files(tmp_path) == {}


def test_a_tail_of_another_branch_is_not_shared(tmp_path, stores):
    s = stores(tmp_path)
    a, b = list(range(10)), list(range(9)) + [99]  # same parent, tails [8, 9] and [8, 99]
    assert s.put("a", a, records(a)) and s.put("b", b, records(b))
    assert len(tail_files(tmp_path)) == 2
    assert np.array_equal(bits(s.load_tail("a")), bits(records(a)[-1].data))
    assert np.array_equal(bits(s.load_tail("b")), bits(records(b)[-1].data))
    check_accounting(s, tmp_path)


def test_the_budget_counts_a_shared_tail_once(tmp_path, stores):
    toks = list(range(11))
    data = kv(b"seq", 11)
    with stores(tmp_path / "probe") as p:
        assert p.put("a", toks, turn_records(toks, data))
        one = p.stats()["bytes_on_disk"]
        assert p.put("p", toks[:9], turn_records(toks[:9], data))
        both = p.stats()["bytes_on_disk"]
    man = both - one  # the second entry adds its manifest only
    s = stores(tmp_path / "s", max_bytes=both)
    assert s.put("p", toks[:9], turn_records(toks[:9], data))
    assert s.put("a", toks, turn_records(toks, data))  # fits: the prompt's tail file goes
    assert sorted(s.keys()) == ["a", "p"] and s.stats()["evictions"] == 0
    assert s.stats()["bytes_on_disk"] == both and man < 1000
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
        assert s.load_tail("k") is None  # its tail is a miss, never a crash
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
    assert s.stats()["tail_pages"] <= 1
    manifests = sum(v for k, v in data_files(tmp_path).items() if k.startswith("entries/"))
    assert s.stats()["pages"] == len(toks) // P  # each page once, headers included:
    assert s.stats()["bytes_on_disk"] - manifests <= 1.06 * final_kv
    check_accounting(s, tmp_path)


# -- restart ---------------------------------------------------------------------------------------


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
        assert s.stats()[k] == before[k]
    assert sum(read) <= header_bytes  # headers read at start-up; get() reads no file
    monkeypatch.undo()
    t = convs["k3"]
    assert np.array_equal(bits(s.load_page(hashes(t)[1])), bits(records(t)[1].data))
    assert np.array_equal(bits(s.load_tail("k3")), bits(records(t)[-1].data))


def test_a_second_store_on_the_same_root_is_refused(tmp_path, stores):
    s = stores(tmp_path)
    with pytest.raises(DiskStoreLockedError):
        DiskStore(tmp_path, **GEO, max_bytes=1 << 20)
    s.close()
    with stores(tmp_path) as s2:
        assert s2.keys() == []
    with pytest.raises(RuntimeError):
        s2.keys()


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
    assert s.stats()["temp_files_removed"] == 3
    assert not s.has_page(orphan.hash) and not page_path(tmp_path, orphan.hash).exists()
    assert s.keys() == ["k"] and s.get("k").tokens == tuple(toks)
    assert not [f for f in tree(tmp_path) if ".tmp." in f]
    check_accounting(s, tmp_path)


# -- corruption ------------------------------------------------------------------------------------

SMALL = dict(GEO, num_layers=1, num_kv_heads=1, head_dim=2, page_size=2)
SMALL_TOKS = [7, 8, 9]  # one page and a tail of one


def small_files(tmp_path, stores):
    src = tmp_path / "src"
    with stores(src, **SMALL) as s:
        assert s.put("k", SMALL_TOKS, records(SMALL_TOKS, SMALL))
    h = hashes(SMALL_TOKS, SMALL)[0]
    return h, page_path(src, h).read_bytes(), entry_path(src, "k").read_bytes()


def fresh(root: Path) -> Path:
    """An empty directory at ``root`` (one reused root keeps the inode churn small)."""
    if root.exists():
        shutil.rmtree(root)
    return root


def install(root: Path, h: bytes, page: bytes | None, manifest: bytes | None) -> None:
    for path, raw in ((page_path(root, h), page), (entry_path(root, "k"), manifest)):
        path.parent.mkdir(parents=True, exist_ok=True)
        if raw is not None:
            path.write_bytes(raw)


def assert_page_miss(s: DiskStore, root: Path, h: bytes) -> None:
    assert s.load_page(h) is None and not s.has_page(h)
    assert not page_path(root, h).exists()


def assert_entry_miss(s: DiskStore, root: Path) -> None:
    assert s.load_entry("k") is None  # a live file is found when the entry is loaded
    assert s.get("k") is None and s.keys() == [] and not entry_path(root, "k").exists()


@pytest.mark.parametrize("which", ["page", "manifest"])
def test_every_truncation_is_a_miss_and_removed(tmp_path, stores, which):
    h, page, man = small_files(tmp_path, stores)
    full = page if which == "page" else man
    for n in range(len(full)):
        for live in (False, True):
            root = fresh(tmp_path / "r")
            bad = full[:n]
            install(root, h, page if which == "manifest" or live else bad,
                    man if which == "page" or live else bad)
            s = stores(root, **SMALL)
            if live:
                (page_path(root, h) if which == "page" else entry_path(root, "k")).write_bytes(bad)
            if which == "page":
                assert_page_miss(s, root, h)
                assert s.get("k").tokens == tuple(SMALL_TOKS)  # the entry itself is fine
            else:
                assert_entry_miss(s, root)
                assert not s.has_page(h)  # its page went with it (nothing else holds it)
            assert s.stats()["corrupt_files_removed"] >= 1
            check_accounting(s, root)
            s.close()


@pytest.mark.parametrize("which", ["page", "manifest"])
def test_every_flipped_byte_is_a_miss_and_removed(tmp_path, stores, which):
    h, page, man = small_files(tmp_path, stores)
    full = page if which == "page" else man
    for i in range(len(full)):
        bad = bytearray(full)
        bad[i] ^= 0x01
        root = fresh(tmp_path / "r")
        install(root, h, bytes(bad) if which == "page" else page,
                bytes(bad) if which == "manifest" else man)
        s = stores(root, **SMALL)
        if which == "page":
            assert_page_miss(s, root, h)
        else:
            assert_entry_miss(s, root)
        assert s.stats()["corrupt_files_removed"] + s.stats()["foreign_files_removed"] >= 1
        s.close()


def test_flipped_data_byte_fails_the_checksum_on_a_live_store(tmp_path, stores):
    s = stores(tmp_path)
    toks = list(range(7))
    assert s.put("k", toks, records(toks))
    h = hashes(toks)[0]
    for path in (page_path(tmp_path, h), entry_path(tmp_path, "k")):
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0x80
        path.write_bytes(bytes(raw))
    assert s.get("k").tokens == tuple(toks)  # metadata is intact
    assert s.load_page(h) is None and not page_path(tmp_path, h).exists()
    assert s.load_tail("k") is None and s.get("k") is None
    assert s.stats()["corrupt_files_removed"] == 2 and data_files(tmp_path) == {}


def test_a_restore_reads_each_page_once_and_parses_no_header(tmp_path, stores, monkeypatch):
    """Pages are checked against what the index learnt from their headers (at start-up or
    when written): a restore reads the file and hashes it, and parses no header again."""
    toks = list(range(4 * 6 + 1))
    with stores(tmp_path) as s:
        assert s.put("k", toks, records(toks))
    s = stores(tmp_path)  # indexed from the headers at start-up
    for where in ("parse_header", "parse_page", "read_header", "parse_entry"):
        monkeypatch.setattr(fmt, where, lambda *a, w=where, **k: pytest.fail(f"{w} called"))
    got = s.load_pages(hashes(toks))
    for r in records(toks)[:-1]:
        assert np.array_equal(bits(got[r.hash]), bits(r.data))
    monkeypatch.undo()
    # A manifest as indexed: its metadata (tokens, page hashes) is not parsed again.
    monkeypatch.setattr(fmt, "parse_entry", lambda *a, **k: pytest.fail("parse_entry called"))
    e = s.load_entry("k")
    assert e.entry.tokens == tuple(toks) and e.entry.page_hashes == hashes(toks)
    assert np.array_equal(bits(e.tails[0]), bits(records(toks)[-1].data))


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
        assert mx.array_equal(arr[:, :, :, :4, :], s.load_page(hashes(toks)[0]), equal_nan=True).item()
    assert not path.exists() and s.stats()["corrupt_files_removed"] == 1
    assert (s._reader._threads is not None) == threads


def test_zero_length_files(tmp_path, stores):
    h = hashes(SMALL_TOKS, SMALL)[0]
    install(tmp_path, h, b"", b"")
    s = stores(tmp_path, **SMALL)
    assert s.keys() == [] and not s.has_page(h) and data_files(tmp_path) == {}
    assert s.stats()["corrupt_files_removed"] == 2


FOREIGN = [dict(fingerprint="model-b"), dict(dtype=mx.bfloat16), dict(dtype=mx.float32),
           dict(num_layers=3), dict(num_kv_heads=1), dict(head_dim=8), dict(page_size=2)]


@pytest.mark.parametrize("other", FOREIGN, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_files_of_another_model_or_geometry_are_never_used(tmp_path, stores, other):
    geo_b = {**GEO, **other}
    toks = list(range(10))
    src = tmp_path / "b"
    with stores(src, **geo_b) as b:
        assert b.put("k", toks, records(toks, geo_b))
    ours = tmp_path / "a"
    a = stores(ours)
    assert a.put("k", toks, records(toks))
    h = hashes(toks)[0]
    # Live: the foreign manifest (same key) and, where the name is the same, a foreign page.
    os.replace(entry_path(src, "k"), entry_path(ours, "k"))
    h_b = hashes(toks, geo_b)[0]
    if h_b == h:
        os.replace(page_path(src, h_b), page_path(ours, h))
        assert a.load_page(h) is None and not page_path(ours, h).exists()
    assert a.load_entry("k") is None and a.get("k") is None
    assert not entry_path(ours, "k").exists()
    assert a.stats()["foreign_files_removed"] == 1 + (h_b == h)
    check_accounting(a, ours)
    a.close()
    # At start-up: every foreign file is a miss, removed, nothing indexed.
    fresh = tmp_path / "c"
    with stores(src, **geo_b) as b:
        assert b.put("k", toks, records(toks, geo_b))
    os.rename(src, fresh)
    c = stores(fresh)
    assert c.keys() == [] and c.stats()["pages"] == 0 and data_files(fresh) == {}
    tail = len(toks) % geo_b["page_size"] != 0  # a tail file
    assert c.stats()["foreign_files_removed"] == len(toks) // geo_b["page_size"] + 1 + tail


# before cache specs; before xxh3 checksums; before tails stored once
@pytest.mark.parametrize("version", ["1", "2", "3"])
def test_another_format_version_is_foreign(tmp_path, stores, version):
    h, page, man = small_files(tmp_path, stores)
    install(tmp_path / "r", h, page, man)
    for path in (page_path(tmp_path / "r", h), entry_path(tmp_path / "r", "k")):
        header, data = header_of(path)
        meta = header["__metadata__"]
        meta["format_version"] = version
        if version == "2":  # as version 2 wrote it: blake2b-256 checksums
            meta["data_checksum"] = "blake2b-256:" + hashlib.blake2b(
                data, digest_size=32).hexdigest()
            body = {k: v for k, v in meta.items() if k != "meta_checksum"}
            meta["meta_checksum"] = "blake2b-256:" + hashlib.blake2b(json.dumps(
                body, sort_keys=True, separators=(",", ":")).encode(), digest_size=32).hexdigest()
        write_with_header(path, header, data, reseal=version != "2")
    s = stores(tmp_path / "r", **SMALL)
    assert s.keys() == [] and s.stats()["foreign_files_removed"] == 2
    assert data_files(tmp_path / "r") == {}


def hostile_headers(header: dict, data: bytes):
    """(name, raw file bytes) of hostile variants of a valid page file."""
    n = len(json.dumps(header).encode())
    t = header["kv"]

    def variant(**changes):
        h = json.loads(json.dumps(header))
        for k, v in changes.items():
            if k == "meta":
                h["__metadata__"] = v
            elif k.startswith("meta_"):
                h["__metadata__"][k[5:]] = v
            else:
                h["kv"][k] = v
        if isinstance(h.get("__metadata__"), dict) and all(
                isinstance(v, str) for v in h["__metadata__"].values()):
            fmt.seal_metadata(h["__metadata__"])
        raw = json.dumps(h).encode()
        return struct.pack("<Q", len(raw)) + raw + data

    raw = json.dumps(header).encode()
    yield "length past the end", struct.pack("<Q", n + len(data) + 9) + raw + data
    yield "length 2**64-1", struct.pack("<Q", 2**64 - 1) + raw + data
    yield "length 0", struct.pack("<Q", 0) + raw + data
    big = b'{"__metadata__":{"x":"' + b"a" * (17 << 20) + b'"}}'
    yield "huge header", struct.pack("<Q", len(big)) + big
    deep = b"[" * 200_000 + b"]" * 200_000
    yield "deeply nested", struct.pack("<Q", len(deep)) + deep
    yield "not utf-8", struct.pack("<Q", 4) + b"\xff\xfe{}"
    yield "a JSON array", struct.pack("<Q", 2) + b"[]"
    yield "offsets past the end", variant(data_offsets=[0, t["data_offsets"][1] + 64],
                                          shape=t["shape"][:-1] + [t["shape"][-1] + 16])
    yield "offsets short of the end", variant(data_offsets=[0, 2], shape=[1])
    yield "offsets reversed", variant(data_offsets=[8, 0])
    yield "offsets of the wrong type", variant(data_offsets="0-16")
    yield "unknown dtype", variant(dtype="F128")
    yield "other dtype", variant(dtype="I16")
    yield "negative shape", variant(shape=[-1, 2, 1, 2, -2])
    yield "bool shape", variant(shape=[True, 2, 1, 2, 2])
    yield "metadata a list", variant(meta=["a"])
    yield "metadata missing", variant(meta=None)
    yield "metadata value a number", variant(meta_page_size=2)
    yield "tokens not JSON", variant(meta_tokens="[7,")
    yield "tokens of strings", variant(meta_tokens='["7","8"]')
    yield "tokens of bools", variant(meta_tokens="[true,false]")
    yield "tokens too big", variant(meta_tokens=f"[{2**64},8]")
    yield "tokens that do not hash", variant(meta_tokens="[7,9]")
    yield "hash not hex", variant(meta_hash="zz")
    yield "page size huge", variant(meta_page_size="9" * 5000)


def test_hostile_page_headers_are_misses(tmp_path, stores):
    h, page, man = small_files(tmp_path, stores)
    (n,) = struct.unpack("<Q", page[:8])
    header, data = json.loads(page[8 : 8 + n]), page[8 + n :]
    for i, (name, raw) in enumerate(hostile_headers(header, data)):
        for live in (False, True):
            root = fresh(tmp_path / "r")
            install(root, h, page if live else raw, man)
            s = stores(root, **SMALL)
            if live:
                page_path(root, h).write_bytes(raw)
            assert s.load_page(h) is None, name
            assert not page_path(root, h).exists(), name
            assert s.get("k").tokens == tuple(SMALL_TOKS)
            s.close()


def test_hostile_manifest_headers_are_misses(tmp_path, stores):
    h, page, man = small_files(tmp_path, stores)
    header, data = header_of_bytes(man)
    variants = {
        "key of another type": ("key", None),
        "page_hashes not a list": ("page_hashes", '"ab"'),
        "page_hashes not hex": ("page_hashes", '["xyz"]'),
        "page_hashes of another chain": ("page_hashes", json.dumps(["00" * 32])),
        "tail_tokens too big": ("tail_tokens", "2"),
        "tail_tokens negative": ("tail_tokens", "-1"),
        "tokens short": ("tokens", "[7,8]"),
        "key of another message": ("key", "other"),
    }
    for i, (name, (field, value)) in enumerate(variants.items()):
        hd = json.loads(json.dumps(header))
        if value is None:
            hd["__metadata__"][field] = 5
            raw = json.dumps(hd).encode()
            raw = struct.pack("<Q", len(raw)) + raw + data
        else:
            hd["__metadata__"][field] = value
            fmt.seal_metadata(hd["__metadata__"])
            raw = json.dumps(hd).encode()
            raw = struct.pack("<Q", len(raw)) + raw + data
        for live in (False, True):
            root = fresh(tmp_path / "r")
            install(root, h, page, man if live else raw)
            s = stores(root, **SMALL)
            if live:
                entry_path(root, "k").write_bytes(raw)
            assert s.load_entry("k") is None and s.load_tail("k") is None, name
            assert s.get("k") is None, name
            assert not entry_path(root, "k").exists() and s.keys() == [], name
            s.close()


def header_of_bytes(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


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
    assert s.load_page(hashes(b)[1]) is None and not s.has_page(hashes(b)[1])
    assert s.get("b").page_hashes == hashes(b)  # the caller reuses the prefix before the gap
    check_accounting(s, tmp_path)


def test_a_manifest_under_another_keys_name_is_a_miss(tmp_path, stores):
    s = stores(tmp_path)
    assert s.put("a", [1, 2], records([1, 2]))
    assert s.put("b", [3, 4], records([3, 4]))
    os.replace(entry_path(tmp_path, "a"), entry_path(tmp_path, "b"))
    assert s.load_entry("b") is None and s.load_entry("a") is None
    assert s.get("b") is None and s.get("a") is None and s.keys() == []
    assert data_files(tmp_path) == {}


# -- hostile keys and planted links ----------------------------------------------------------------

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
        assert s.load_tail(key) is not None
    assert sorted(os.listdir(tmp_path)) == ["store"]
    assert sorted(os.listdir(root)) == [".lock", "entries", "pages", "tails"]
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
    assert s.load_page(h0) is None and s.load_entry("k") is None and s.get("k") is None
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
    assert np.array_equal(bits(s.load_page(h1)), bits(records(toks)[1].data))
    check_accounting(s, root)


def test_special_files_are_not_opened(tmp_path, stores):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    h = hashes(SMALL_TOKS, SMALL)[0]
    install(tmp_path, h, None, None)
    os.mkfifo(page_path(tmp_path, h))
    os.mkfifo(entry_path(tmp_path, "k"))
    s = stores(tmp_path, **SMALL)  # would hang if a FIFO were opened for reading blocking
    assert s.keys() == [] and not os.path.lexists(page_path(tmp_path, h))


# -- budget ----------------------------------------------------------------------------------------


def conv(i: int) -> list[int]:
    return [1000 + 10 * i + j for j in range(8)]  # two full pages, same digit count for all


def entry_bytes(tmp_path, stores) -> int:
    with stores(tmp_path / "measure") as m:
        assert m.put("a", conv(0), records(conv(0)))
        return m.stats()["bytes_on_disk"]


def test_budget_evicts_least_recently_used_first(tmp_path, stores):
    size = entry_bytes(tmp_path, stores)
    root = tmp_path / "s"
    s = stores(root, max_bytes=3 * size)
    for i, k in enumerate("abc"):
        assert s.put(k, conv(i), records(conv(i)))
        check_accounting(s, root)
    assert s.stats()["bytes_on_disk"] == 3 * size
    assert s.put("d", conv(3), records(conv(3)))
    assert s.keys() == ["b", "c", "d"] and s.stats()["evictions"] == 1
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
    assert s.stats()["refused"] == 1 and s.stats()["evictions"] == 3
    # Bigger than the whole budget: refused, nothing evicted, nothing written.
    big = list(range(4 * 8))
    assert not s.put("huge", big, records(big))
    assert tree(root) == before
    # Replacing an entry: its old pages that nothing else holds go with the old manifest.
    assert s.put("d", conv(7), records(conv(7)))
    assert not any(s.has_page(h) for h in hashes(conv(3)))
    assert s.keys() == ["b", "f", "d"] and s.stats()["evictions"] == 3
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
    need = s.stats()["bytes_on_disk"] - entry_path(tmp_path / "m", "x").stat().st_size
    s.close()
    root = tmp_path / "s"
    s = stores(root, max_bytes=need)
    assert s.put("x", x, records(x)) and s.put("y", y, records(y))
    assert s.put("z", z, records(z))
    assert s.keys() == ["y", "z"] and s.stats()["evictions"] == 1
    assert all(s.has_page(h) for h in hashes(y))  # x's pages stay: y holds them
    assert np.array_equal(bits(s.load_page(hashes(x)[0])), bits(records(x)[0].data))
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
    assert s.load_page(hashes(conv(0))[1]) is not None
    check_accounting(s, root)


def test_s3fifo_policy_keeps_the_budget_and_pins(tmp_path, stores):
    size = entry_bytes(tmp_path, stores)
    root = tmp_path / "s"
    s = stores(root, max_bytes=3 * size, policy="s3fifo")
    assert s.stats()["policy"] == "s3fifo"
    for i in range(12):
        s.touch("k0")
        assert s.put(f"k{i}", conv(i), records(conv(i)), pinned={"k0"})
        check_accounting(s, root)
        assert "k0" in s.keys() and len(s.keys()) <= 3
    with pytest.raises(ValueError):
        stores(tmp_path / "x", policy="nope")


# -- write errors ----------------------------------------------------------------------------------


# A real read-only directory (chmod, with the capabilities that bypass file permissions dropped
# so it also holds as root) is checked end to end in
# tests/test_faults.py::test_real_read_only_dirs_for_an_unprivileged_process; the store's own
# handling of the errors is pinned below with injected PermissionError and ENOSPC.


def failing(after: int, exc: Exception, real):
    calls = []

    def f(*a, **k):
        calls.append(1)
        if len(calls) > after:
            raise exc
        return real(*a, **k)

    return f


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
    assert s.stats()["errors"] == 1
    assert tree(tmp_path) == before  # no temp files, no half-written entry, no stray pages
    assert s.keys() == ["k"] and s.get("k").tokens == tuple(toks)
    assert s.load_page(hashes(toks)[0]) is not None and s.load_tail("k") is not None
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
    assert tree(root) == before and s.keys() == ["a"] and s.stats()["errors"] == 1
    check_accounting(s, root)
    assert s.put("b", conv(1), records(conv(1)))  # "a" is still a candidate, and goes now
    assert s.keys() == ["b"] and s.stats()["evictions"] == 1
    check_accounting(s, root)


def test_a_smaller_budget_at_start_evicts_oldest_first(tmp_path, stores):
    size = entry_bytes(tmp_path, stores)
    root = tmp_path / "s"
    s = stores(root)
    for i, k in enumerate("abcd"):
        assert s.put(k, conv(i), records(conv(i)))
    s.touch("a")
    s.close()
    s = stores(root, max_bytes=2 * size)
    assert s.keys() == ["d", "a"] and s.stats()["evictions"] == 2
    check_accounting(s, root)


def test_a_transient_read_error_is_a_miss_that_keeps_the_file(tmp_path, stores, monkeypatch):
    s = stores(tmp_path)
    toks = list(range(6))
    assert s.put("k", toks, records(toks))
    h = hashes(toks)[0]
    for read in ("pread", "preadv", "readv"):  # every read of a file fails
        monkeypatch.setattr(os, read, failing(0, OSError(errno.EIO, "I/O error"),
                                              getattr(os, read)))
    assert s.load_page(h) is None and s.load_tail("k") is None and s.load_entry("k") is None
    assert s.get("k").tokens == tuple(toks)  # a transient error keeps the entry indexed
    monkeypatch.undo()
    assert s.stats()["errors"] == 3 and s.stats()["corrupt_files_removed"] == 0
    assert s.has_page(h) and s.get("k").tokens == tuple(toks)
    assert np.array_equal(bits(s.load_page(h)), bits(records(toks)[0].data))
    check_accounting(s, tmp_path)


# -- properties ------------------------------------------------------------------------------------

BRANCHES = [list(range(6)), list(range(10)), list(range(13)), list(range(8)) + [90, 91, 92],
            [5, 6, 7, 8, 9], list(range(4)) + [70] * 9]


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
                held = set()
                for k in s.keys():
                    e = s.get(k)
                    assert list(e.tokens) == model[k]
                    assert all(s.has_page(h) for h in e.page_hashes)
                    held |= set(e.page_hashes)
                assert s.stats()["pages"] == len(held)  # no orphan pages
            for k in s.keys():
                for h in s.get(k).page_hashes:
                    assert s.load_page(h) is not None
        finally:
            s.close()
