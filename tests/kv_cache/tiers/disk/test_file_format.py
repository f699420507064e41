"""The disk store's files (``file_format``, ``framing``): self-describing safetensors; every
truncation, flipped byte, hostile header, foreign model, geometry or format version a miss,
logged and removed, at start-up and on a live store."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.pages.hashing import chain_hashes, root_hash
from kv_cache.tiers.disk import file_format as fmt
from kv_cache.tiers.disk.store import DiskStore
from tests.kv_cache.tiers.disk.disk_helpers import (
    FP, GEO, SMALL, SMALL_TOKS, check_accounting, data_files, entry_path, fresh, hashes, header_of,
    header_of_bytes, install, page_of, page_path, records, small_files, tail_hash, tail_of,
    tail_path, write_with_header,
)


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


# -- corruption -----------------------------------------------------------------------------------


def assert_page_miss(s: DiskStore, root: Path, h: bytes) -> None:
    assert page_of(s, h) is None and not s.has_page(h)
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
            assert s.stats().corrupt_files_removed >= 1
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
        assert s.stats().corrupt_files_removed + s.stats().foreign_files_removed >= 1
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
    assert page_of(s, h) is None and not page_path(tmp_path, h).exists()
    assert tail_of(s, "k") is None and s.get("k") is None
    assert s.stats().corrupt_files_removed == 2 and data_files(tmp_path) == {}


def test_zero_length_files(tmp_path, stores):
    h = hashes(SMALL_TOKS, SMALL)[0]
    install(tmp_path, h, b"", b"")
    s = stores(tmp_path, **SMALL)
    assert s.keys() == [] and not s.has_page(h) and data_files(tmp_path) == {}
    assert s.stats().corrupt_files_removed == 2


def test_a_manifest_under_another_keys_name_is_a_miss(tmp_path, stores):
    s = stores(tmp_path)
    assert s.put("a", [1, 2], records([1, 2]))
    assert s.put("b", [3, 4], records([3, 4]))
    os.replace(entry_path(tmp_path, "a"), entry_path(tmp_path, "b"))
    assert s.load_entry("b") is None and s.load_entry("a") is None
    assert s.get("b") is None and s.get("a") is None and s.keys() == []
    assert data_files(tmp_path) == {}


# -- foreign files --------------------------------------------------------------------------------


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
        assert page_of(a, h) is None and not page_path(ours, h).exists()
    assert a.load_entry("k") is None and a.get("k") is None
    assert not entry_path(ours, "k").exists()
    assert a.stats().foreign_files_removed == 1 + (h_b == h)
    check_accounting(a, ours)
    a.close()
    # At start-up: every foreign file is a miss, removed, nothing indexed.
    fresh = tmp_path / "c"
    with stores(src, **geo_b) as b:
        assert b.put("k", toks, records(toks, geo_b))
    os.rename(src, fresh)
    c = stores(fresh)
    assert c.keys() == [] and c.stats().pages == 0 and data_files(fresh) == {}
    tail = len(toks) % geo_b["page_size"] != 0  # a tail file
    assert c.stats().foreign_files_removed == len(toks) // geo_b["page_size"] + 1 + tail


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
    assert s.keys() == [] and s.stats().foreign_files_removed == 2
    assert data_files(tmp_path / "r") == {}


# -- hostile headers ------------------------------------------------------------------------------


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
            assert page_of(s, h) is None, name
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
            assert s.load_entry("k") is None and tail_of(s, "k") is None, name
            assert s.get("k") is None, name
            assert not entry_path(root, "k").exists() and s.keys() == [], name
            s.close()


def test_files_with_images_name_them_and_text_files_do_not(tmp_path, stores):
    from kv_cache.pages.spans import as_spans, page_extras
    from kv_cache.tiers.base import PageRecord
    from tests.kv_cache.tiers.disk.disk_helpers import kv

    s = stores(tmp_path)
    toks = list(range(7))
    assert s.put("text", toks, records(toks))
    meta = header_of(page_path(tmp_path, hashes(toks)[0]))[0]["__metadata__"]
    assert "extras" not in meta and "tokens" in meta  # a text page's file is as before images
    assert "spans" not in header_of(entry_path(tmp_path, "text"))[0]["__metadata__"]
    spans = as_spans([(2, 3, "c" * 64)])  # positions 2..4: pages 0 and 1
    chain = chain_hashes(root_hash(FP), toks, 4, spans=spans)
    assert chain[0] != hashes(toks)[0]
    recs = [PageRecord(chain[0], tuple(toks[:4]), kv(chain[0], 4)),
            PageRecord(None, tuple(toks[4:]), kv(b"tail", 3))]
    assert s.put("image", toks, recs, spans=spans)
    page_meta = header_of(page_path(tmp_path, chain[0]))[0]["__metadata__"]
    assert json.loads(page_meta["extras"]) == [list(e) for e in page_extras(spans, 0, 4)]
    entry_meta = header_of(entry_path(tmp_path, "image"))[0]["__metadata__"]
    assert json.loads(entry_meta["spans"]) == [[2, 3, "c" * 64]]
    s.close()
    s = stores(tmp_path)  # read back at start-up: both entries, each with its own spans
    assert s.get("text").spans == () and s.get("image").spans == spans
    assert s.load_entry("image").entry.spans == spans
    assert s.find_end(toks + [9], 7, spans) == "image" and s.find_end(toks + [9], 7) == "text"
    s.close()
    # an image's keys changed in a page's file (its checksum made good again): a miss
    path = page_path(tmp_path, chain[0])
    header, data = header_of(path)
    header["__metadata__"]["extras"] = json.dumps([["d" * 64, -2, 3]])
    write_with_header(path, header, data)
    s = stores(tmp_path)
    assert page_of(s, chain[0]) is None and not path.exists()
