"""What the disk store's tests share: a small geometry, page records of random bits, the paths
of the files a store writes, and reads through the store's public calls."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np

from kv_cache.pages.hashing import chain_hashes, page_hash, root_hash
from kv_cache.tiers.base import PageRecord
from kv_cache.tiers.disk import file_format as fmt
from kv_cache.tiers.disk.index import entry_name
from kv_cache.tiers.disk.store import DiskStore

FP = "model-a"
GEO = dict(fingerprint=FP, num_layers=2, num_kv_heads=2, head_dim=4, page_size=4,
           dtype=mx.float16)
BITS = {mx.float16: (np.uint16, mx.uint16), mx.bfloat16: (np.uint16, mx.uint16),
        mx.float32: (np.uint32, mx.uint32)}
FILE_RE = re.compile(r"(entries/[0-9a-f]{64}|(pages|tails)/([0-9a-f]{2})/\3[0-9a-f]{62})"
                     r"\.safetensors")


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
    return chain_hashes(root_hash(geo["fingerprint"]), tokens, geo["page_size"])


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


def header_of_bytes(raw: bytes) -> tuple[dict, bytes]:
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
    assert store.stats().bytes_on_disk == sum(files.values())
    assert store.stats().bytes_on_disk <= store.stats().budget


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


def conv(i: int) -> list[int]:
    return [1000 + 10 * i + j for j in range(8)]  # two full pages, same digit count for all


def entry_bytes(tmp_path, stores) -> int:
    with stores(tmp_path / "measure") as m:
        assert m.put("a", conv(0), records(conv(0)))
        return m.stats().bytes_on_disk


def failing(after: int, exc: Exception, real):
    calls = []

    def f(*a, **k):
        calls.append(1)
        if len(calls) > after:
            raise exc
        return real(*a, **k)

    return f


def page_of(store: DiskStore, h: bytes) -> mx.array | None:
    """Page ``h`` as a restore reads it (``load_pages``)."""
    return store.load_pages([h])[h]


def tail_of(store: DiskStore, key: str) -> mx.array | None:
    """Group 0's open tail page of ``key`` as a restore reads it (``load_entry``); None when
    the entry has none or is missing, corrupt or foreign."""
    got = store.load_entry(key)
    return None if got is None else got.tails.get(0)
