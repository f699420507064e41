"""The disk store's file format: safetensors files with self-describing metadata, written
atomically and read defensively.

A file is standard safetensors (an 8-byte little-endian header length, a JSON header, the tensor
bytes), readable by ``mx.load`` and the ``safetensors`` package; bfloat16 is stored as ``BF16``.
The header's ``__metadata__`` (strings only) says what the file is and for which model:

    format          "mlx-kvcache-page", "mlx-kvcache-tail" or "mlx-kvcache-entry"
    format_version  FORMAT_VERSION ("4")
    fingerprint, page_size
    cache_spec      the model's cache spec as canonical JSON (``kv_cache.model.spec``): its paged groups
                    (kind, layers, heads, head size, dtype, window) and recurrent-state slots
    tokens          JSON list of token ids
    page:   group, hash, parent (hex; hash == page_hash(parent, tokens), in that group's chain);
            tensor "kv" [group layers, 2, H, P, D] in the group's dtype
    tail:   a partial page, as a page but with 1..P-1 tokens (hash == page_hash(parent,
            tokens) too) and tensor "kv" [group layers, 2, H, tokens, D]
    entry:  key (the message id, only here), page_hashes (JSON list of hex, every group's pages
            one group after another), layout (JSON [[skip, count], ...] per group: the first
            ``skip`` full pages are not stored, as no sliding window at the entry's end reads
            them, then ``count`` pages), tail_tokens, state ("1" when the entry carries the
            recurrent state after its tokens); tensors "state.<slot>.<i>" per recurrent-state
            array. An entry's open tail page (its last tail_tokens tokens, per group) is not in
            the manifest: it is the first tail_tokens positions of any stored page or tail
            whose parent is the entry's last full page's chain hash (the group's root when
            there is none) and whose tokens begin with the entry's tail tokens
    data_checksum   xxh3-128 of the tensor bytes (checked when data is loaded)
    meta_checksum   xxh3-128 of the canonical JSON of every other metadata field

The checksums detect corruption (torn writes, flipped bits, truncation); they are not
authentication. Page identity is the page hash (sha256 chain, ``kv_cache.pages.hashing``), checked
against the tokens in the header.

Version 4 (this one) stores an entry's open tail page once, as a content-addressed partial page
(a "tail" file) that every entry ending inside that page shares, each with its own length, and
that a longer tail or the full page continuing it replaces; version 3 kept a copy of the tail in
every manifest. Version 3 checks with xxh3-128 instead of version 2's blake2b-256: xxh3 runs at
memory speed (~19 GB/s here against ~0.9 GB/s), so verifying is no longer what limits a
restore. Version 2 replaced version 1's one page shape (dtype, num_layers, num_kv_heads,
head_dim) by the cache spec, and added page groups, entry layouts and state snapshots. Files of
another version are foreign: a miss, logged and removed.

This module writes the format itself (JSON framing around raw little-endian bytes): numpy has no
bfloat16 and the ``safetensors`` writer's API changed in 0.8; the tests read the files back with
``mx.load`` and ``safetensors.safe_open``.

Readers trust nothing: header length, JSON, offsets, dtypes and sizes are checked against the file
size before any tensor byte is touched. ``FormatError`` is a file that is not a valid file of
ours; ``ForeignError`` a valid one for another model, geometry or format version.
"""

from __future__ import annotations

import functools
import json
import re
import struct
import threading
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np
import xxhash

from kv_cache.tiers.disk.atomic_fs import read_at, read_into
from kv_cache.errors import ForeignError, FormatError  # noqa: F401 - the format's errors
from kv_cache.pages.hashing import chain_hashes, page_hash, root_hash
from kv_cache.pages.memory import new_array
from kv_cache.model.spec import CacheSpec

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

FORMAT_VERSION = "4"
PAGE_FORMAT = "mlx-kvcache-page"
TAIL_FORMAT = "mlx-kvcache-tail"
ENTRY_FORMAT = "mlx-kvcache-entry"
MAX_HEADER_BYTES = 16 << 20  # hostile-header cap
INT64 = (-(1 << 63), 1 << 63)

# store dtype name -> (mx dtype, safetensors code, numpy storage dtype)
DTYPES: dict[str, tuple[mx.Dtype, str, np.dtype]] = {
    "float16": (mx.float16, "F16", np.dtype("<f2")),
    "bfloat16": (mx.bfloat16, "BF16", np.dtype("<u2")),  # numpy has no bf16: raw 16-bit words
    "float32": (mx.float32, "F32", np.dtype("<f4")),
}
# Every safetensors dtype code and its item size (structural check of any header).
ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_UINT = re.compile(r"[0-9]{1,9}")


def dtype_name(dtype: mx.Dtype) -> str:
    for name, (dt, _, _) in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"the disk store keeps float16, bfloat16 or float32 pages, not {dtype}")


CHECKSUM_PREFIX = "xxh3-128:"


def checksum(*chunks) -> str:
    if len(chunks) == 1:
        return CHECKSUM_PREFIX + xxhash.xxh3_128_hexdigest(chunks[0])
    h = xxhash.xxh3_128()
    for c in chunks:
        h.update(c)
    return CHECKSUM_PREFIX + h.hexdigest()


@dataclass(frozen=True, slots=True)
class Geometry:
    """What a file must say to be usable by a store (anything else is foreign)."""

    fingerprint: str
    page_size: int
    spec: CacheSpec

    @classmethod
    def plain(cls, fingerprint: str, dtype: str, page_size: int, num_layers: int,
              num_kv_heads: int, head_dim: int) -> "Geometry":
        """One group of full-attention layers."""
        spec = CacheSpec.plain(num_layers, num_kv_heads, head_dim, DTYPES[dtype][0])
        return cls(fingerprint, page_size, spec)

    @property
    def dtype(self) -> str:
        """Group 0's dtype."""
        return self.spec.groups[0].dtype

    def root(self, group: int = 0) -> bytes:
        return root_hash(self.fingerprint, group)

    def shape(self, n: int, group: int = 0) -> list[int]:
        return list(self.spec.groups[group].shape(n))

    def group_dtype(self, group: int) -> str:
        return self.spec.groups[group].dtype

    def state_tensors(self) -> dict[str, tuple[list[int], str]]:
        """Name -> (shape, dtype) of every recurrent-state tensor of an entry."""
        return {f"state.{si}.{i}": (list(shape), dt)
                for si, s in enumerate(self.spec.states)
                for i, (shape, dt) in enumerate(zip(s.shapes, s.dtypes))}

    def metadata(self) -> dict[str, str]:
        return dict(_geometry_metadata(self))


@functools.lru_cache(maxsize=32)
def _geometry_metadata(geo: Geometry) -> dict[str, str]:
    """What every file of ``geo`` says (once per geometry: the spec's JSON is not free, and every
    header read compares it). Callers copy before changing it."""
    return {"format_version": FORMAT_VERSION, "fingerprint": geo.fingerprint,
            "page_size": str(geo.page_size), "cache_spec": geo.spec.to_json()}


# -- tensors <-> bytes ----------------------------------------------------------------------------


def host_array(a: mx.array) -> np.ndarray:
    """``a``'s raw bytes as a numpy array (zero-copy for float16/float32), for handing data to a
    thread that must not run MLX; ``to_storage`` accepts it as is."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    mx.eval(a)
    return np.asarray(a)


def to_storage(a: mx.array | np.ndarray, dtype: str) -> np.ndarray:
    """``a`` (cast to ``dtype``) as a C-contiguous little-endian numpy array of its raw bytes.
    A numpy array is taken as already in the storage form (see ``host_array``)."""
    dt, _, np_dt = DTYPES[dtype]
    if isinstance(a, np.ndarray):
        if a.dtype != np_dt:
            raise ValueError(f"host data of dtype {a.dtype} for a {dtype} store")
        return np.ascontiguousarray(a)
    a = a.astype(dt)
    if dt == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.asarray(a), dtype=np_dt)


def from_storage(buf, offset: int, shape: Sequence[int], dtype: str) -> mx.array:
    dt, _, np_dt = DTYPES[dtype]
    count = int(np.prod(shape)) if shape else 1
    arr = mx.array(np.frombuffer(buf, dtype=np_dt, count=count, offset=offset).reshape(shape))
    return arr.view(mx.bfloat16) if dt == mx.bfloat16 else arr


def encode(tensors: dict[str, np.ndarray], codes: dict[str, str] | str,
           metadata: dict[str, str]) -> list:
    """A safetensors file as chunks: the header (length + JSON, padded to 8) and tensor buffers.
    ``codes``: each tensor's safetensors dtype code (or one code for all)."""
    header: dict = {"__metadata__": metadata}
    offset, chunks = 0, []
    for name, arr in tensors.items():
        code = codes if isinstance(codes, str) else codes[name]
        header[name] = {"dtype": code, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        chunks.append(arr)
    raw = json.dumps(header, separators=(",", ":")).encode()  # ensure_ascii: pure ASCII
    raw += b" " * (-len(raw) % 8)
    if len(raw) > MAX_HEADER_BYTES:
        raise FormatError(f"header of {len(raw)} bytes is over the {MAX_HEADER_BYTES} cap")
    return [struct.pack("<Q", len(raw)) + raw, *chunks]


def meta_checksum(meta: dict[str, str]) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_checksum"}
    return checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def seal_metadata(meta: dict[str, str]) -> dict[str, str]:
    meta["meta_checksum"] = meta_checksum(meta)
    return meta


def page_metadata(geo: Geometry, h: bytes, parent: bytes, tokens: Sequence[int],
                  data_sum: str, group: int = 0, kind: str = PAGE_FORMAT) -> dict[str, str]:
    return seal_metadata({"format": kind, **geo.metadata(), "group": str(group),
                          "hash": h.hex(),
                          "parent": parent.hex(), "tokens": json.dumps(list(tokens)),
                          "data_checksum": data_sum})


def entry_metadata(geo: Geometry, key: str, tokens: Sequence[int], hashes: Sequence[bytes],
                   tail_tokens: int, data_sum: str, layout: Sequence[tuple[int, int]],
                   state: bool) -> dict[str, str]:
    return seal_metadata({"format": ENTRY_FORMAT, **geo.metadata(), "key": key,
                          "tokens": json.dumps(list(tokens)),
                          "page_hashes": json.dumps([h.hex() for h in hashes]),
                          "layout": json.dumps([list(x) for x in layout]),
                          "tail_tokens": str(tail_tokens), "state": "1" if state else "0",
                          "data_checksum": data_sum})


# -- parsing --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tensor:
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    start: int  # absolute file offsets
    end: int


@dataclass(frozen=True, slots=True)
class Header:
    size: int  # file size
    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, Tensor]
    digest: bytes = b""  # xxh3-128 of the header's bytes (length and JSON), where read from a file


def head_digest(head: bytes) -> bytes:
    """What a store's index keeps of a file's header bytes, to know the file unchanged later."""
    return xxhash.xxh3_128_digest(head)


def parse_header(prefix: bytes, file_size: int) -> Header:
    """Strict structural check of a safetensors header against the file's size."""
    if file_size < 8 or len(prefix) < 8:
        raise FormatError(f"truncated: {file_size} bytes")
    (n,) = struct.unpack("<Q", prefix[:8])
    if not 2 <= n <= MAX_HEADER_BYTES:
        raise FormatError(f"header length {n} out of range")
    if 8 + n > file_size or len(prefix) < 8 + n:
        raise FormatError(f"header length {n} past the end of a {file_size}-byte file")
    try:
        top = json.loads(prefix[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"header is not JSON: {type(e).__name__}") from None
    if not isinstance(top, dict):
        raise FormatError("header is not a JSON object")
    meta = top.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FormatError("__metadata__ missing or not a map of strings")
    data_start, spans, tensors = 8 + n, [], {}
    for name, info in top.items():
        if not isinstance(info, dict):
            raise FormatError(f"tensor {name!r}: not an object")
        code, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(code, str) or code not in ST_ITEMSIZE:
            raise FormatError(f"tensor {name!r}: unknown dtype")
        if not (isinstance(shape, list) and len(shape) <= 8
                and all(type(d) is int and d >= 0 for d in shape)):
            raise FormatError(f"tensor {name!r}: bad shape")
        if not (isinstance(offs, list) and len(offs) == 2
                and all(type(o) is int for o in offs) and 0 <= offs[0] <= offs[1]):
            raise FormatError(f"tensor {name!r}: bad data_offsets")
        if offs[1] - offs[0] != int(np.prod(shape, dtype=object)) * ST_ITEMSIZE[code]:
            raise FormatError(f"tensor {name!r}: offsets do not match shape and dtype")
        spans.append((offs[0], offs[1]))
        tensors[name] = Tensor(code, tuple(shape), data_start + offs[0], data_start + offs[1])
    pos = 0
    for a, b in sorted(spans):
        if a != pos:
            raise FormatError("tensor data overlaps or leaves holes")
        pos = b
    if data_start + pos != file_size:
        raise FormatError(f"tensor data ends at {data_start + pos}, the file at {file_size}")
    return Header(file_size, data_start, meta, tensors)


def _uint(meta: dict[str, str], name: str) -> int:
    v = meta.get(name)
    if not isinstance(v, str) or not _UINT.fullmatch(v):
        raise FormatError(f"metadata {name!r} is not a small non-negative integer")
    return int(v)


def _json(meta: dict[str, str], name: str):
    try:
        return json.loads(meta.get(name, ""))
    except (ValueError, RecursionError):
        raise FormatError(f"metadata {name!r} is not JSON") from None


def _tokens(meta: dict[str, str]) -> tuple[int, ...]:
    toks = _json(meta, "tokens")
    if not (isinstance(toks, list)
            and all(type(t) is int and INT64[0] <= t < INT64[1] for t in toks)):
        raise FormatError("metadata 'tokens' is not a list of int64 token ids")
    return tuple(toks)


def _hex(v, what: str) -> bytes:
    if not isinstance(v, str) or not _HEX64.fullmatch(v):
        raise FormatError(f"{what} is not a 64-digit hex hash")
    return bytes.fromhex(v)


def check_common(geo: Geometry, h: Header, fmt: str) -> dict[str, str]:
    """Format, version, checksum, model and geometry of a header; its metadata if all agree."""
    meta = h.metadata
    if meta.get("format") != fmt:
        raise FormatError(f"not a {fmt} file")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ForeignError("another format version")
    if meta.get("meta_checksum") != meta_checksum(meta):
        raise FormatError("metadata checksum mismatch")
    for k, v in _geometry_metadata(geo).items():
        if meta.get(k) != v:
            raise ForeignError(f"{k} differs from the store's")
    return meta


def _check_tensors(h: Header, want: dict[str, tuple[list[int], str]], what: str) -> None:
    if {k: (list(t.shape), t.dtype) for k, t in h.tensors.items()} != \
            {k: (shape, DTYPES[dt][1]) for k, (shape, dt) in want.items()}:
        raise FormatError(f"{what} tensors do not match its metadata")


@dataclass(frozen=True, slots=True)
class PageMetaInfo:
    hash: bytes
    parent: bytes
    tokens: tuple[int, ...]
    group: int = 0
    checksum: str = ""  # the data's checksum, as its header gives it


def parse_page(geo: Geometry, h: Header, expect: bytes, kind: str = PAGE_FORMAT) -> PageMetaInfo:
    """A page's header (``kind``: a full page, or a partial page of 1..P-1 tokens)."""
    meta = check_common(geo, h, kind)
    group = _uint(meta, "group")
    if group >= len(geo.spec.groups):
        raise FormatError("a page of no group of this model")
    ph, parent = _hex(meta.get("hash"), "hash"), _hex(meta.get("parent"), "parent")
    tokens = _tokens(meta)
    n = len(tokens)
    if not (n == geo.page_size if kind == PAGE_FORMAT else 0 < n < geo.page_size) \
            or page_hash(parent, tokens) != ph or ph != expect:
        raise FormatError("page hash does not match its tokens, parent or file name")
    _check_tensors(h, {"kv": (geo.shape(n, group), geo.group_dtype(group))}, "page")
    return PageMetaInfo(ph, parent, tokens, group, str(meta.get("data_checksum", "")))


def parse_tail(geo: Geometry, h: Header, expect: bytes) -> PageMetaInfo:
    return parse_page(geo, h, expect, TAIL_FORMAT)


@dataclass(frozen=True, slots=True)
class EntryMetaInfo:
    key: str
    tokens: tuple[int, ...]
    page_hashes: list[bytes]
    tail_tokens: int
    layout: tuple[tuple[int, int], ...] = ()
    has_state: bool = False
    tail_parents: tuple[bytes, ...] = ()  # per group, the parent of its open tail page (if any)


def parse_entry(geo: Geometry, h: Header) -> EntryMetaInfo:
    meta = check_common(geo, h, ENTRY_FORMAT)
    key, tokens, tail = meta.get("key"), _tokens(meta), _uint(meta, "tail_tokens")
    hx, layout = _json(meta, "page_hashes"), _json(meta, "layout")
    if not isinstance(hx, list):
        raise FormatError("metadata 'page_hashes' is not a list")
    hashes = [_hex(x, "page hash") for x in hx]
    P, groups = geo.page_size, geo.spec.groups
    full = len(tokens) // P
    if not (isinstance(layout, list) and len(layout) == len(groups)
            and all(isinstance(x, list) and len(x) == 2 and all(type(v) is int and v >= 0
                                                                  for v in x) for x in layout)):
        raise FormatError("metadata 'layout' is not one [skip, count] per group")
    if not isinstance(key, str) or tail >= P or len(tokens) != P * full + tail \
            or any(skip + count != full for skip, count in layout) \
            or sum(count for _, count in layout) != len(hashes) \
            or meta.get("state") not in ("0", "1"):
        raise FormatError("entry key, tokens, pages and tail do not agree")
    at, parents = 0, []
    for g, (skip, count) in enumerate(layout):
        if skip and groups[g].kind.reads_all:
            raise FormatError("a full-attention group skips pages")
        chain = chain_hashes(geo.root(g), tokens, P)
        if chain[skip:] != hashes[at : at + count]:
            raise FormatError("entry page hashes do not match its tokens")
        at += count
        parents.append(chain[-1] if chain else geo.root(g))
    has_state = meta["state"] == "1"
    _check_tensors(h, geo.state_tensors() if has_state else {}, "entry")
    return EntryMetaInfo(key, tokens, hashes, tail, tuple(tuple(x) for x in layout), has_state,
                         tuple(parents) if tail else ())


def page_file(geo: Geometry, h: bytes, parent: bytes, tokens: Sequence[int],
              data: mx.array, group: int = 0) -> tuple[list, str]:
    """A sealed page's file (or, with fewer than page_size tokens, a tail file), as chunks to
    write, and its data's checksum."""
    dt = geo.group_dtype(group)
    arr = to_storage(data, dt)
    kind = PAGE_FORMAT if len(tokens) == geo.page_size else TAIL_FORMAT
    data_sum = checksum(arr)
    meta = page_metadata(geo, h, parent, tokens, data_sum, group, kind)
    return encode({"kv": arr}, DTYPES[dt][1], meta), data_sum


def entry_file(geo: Geometry, key: str, tokens: Sequence[int], hashes: Sequence[bytes],
               layout: Sequence[tuple[int, int]] | None = None,
               state: Sequence[Sequence[mx.array | np.ndarray]] | None = None) -> list:
    """An entry's manifest (with its recurrent state), as chunks to write. ``layout``: per group
    (skip, count), default all pages of one group. Its open tail page is stored apart (a page
    or tail file that holds it)."""
    full = len(tokens) // geo.page_size
    layout = [(0, full)] if layout is None else list(layout)
    tensors, codes = {}, {}
    if state is not None:
        specs = geo.state_tensors()
        for si, arrays in enumerate(state):
            for i, a in enumerate(arrays):
                name = f"state.{si}.{i}"
                dt = specs[name][1]
                tensors[name], codes[name] = to_storage(a, dt), DTYPES[dt][1]
    meta = entry_metadata(geo, key, tokens, hashes, len(tokens) - geo.page_size * full,
                          checksum(*tensors.values()), layout, state is not None)
    return encode(tensors, codes, meta)


def nbytes(chunks: Sequence) -> int:
    return sum(memoryview(c).nbytes for c in chunks)


def _verified(h: Header, buf: bytes) -> None:
    spans = [memoryview(buf)[t.start : t.end] for t in h.tensors.values()]
    if checksum(*spans) != h.metadata.get("data_checksum"):
        raise FormatError("data checksum mismatch")


def check_page(geo: Geometry, buf, expect: bytes,
               kind: str = PAGE_FORMAT) -> tuple[np.ndarray, str]:
    """A whole page (or tail) file, every check passed: its data as a zero-copy numpy view of
    ``buf`` (storage form) and its dtype name. Runs no MLX (safe in a reader thread)."""
    h = parse_header(buf, len(buf))
    parse_page(geo, h, expect, kind)
    _verified(h, buf)
    t = h.tensors["kv"]
    dt = geo.group_dtype(int(h.metadata["group"]))
    view = np.frombuffer(buf, dtype=DTYPES[dt][2], count=int(np.prod(t.shape)), offset=t.start)
    return view.reshape(t.shape), dt


def page_dest(geo: Geometry, group: int) -> tuple[mx.array, memoryview]:
    """An MLX array for one page of ``group`` and a writable byte view of its memory, for reading
    a page file straight into it (``fill_page``); call ``as_page`` on it once filled."""
    return page_dests(geo, [group])[0]


def page_dests(geo: Geometry, groups: Sequence[int]) -> list[tuple[mx.array, memoryview]]:
    """``page_dest`` for several pages at once (one evaluation for all: cheaper per page)."""
    arrs = [mx.zeros(geo.shape(geo.page_size, g), dtype=storage_dtype(geo, g)) for g in groups]
    mx.eval(arrs)
    return [(a, memoryview(np.array(a, copy=False)).cast("B")) for a in arrs]


def storage_dtype(geo: Geometry, group: int) -> mx.Dtype:
    """The dtype a page of ``group`` is read into: its own, bfloat16 as raw 16-bit words
    (numpy, through which files are read, has no bfloat16; ``as_page`` views it back)."""
    dt = DTYPES[geo.group_dtype(group)][0]
    return mx.uint16 if dt == mx.bfloat16 else dt


def as_page(arr: mx.array, geo: Geometry, group: int) -> mx.array:
    return arr.view(mx.bfloat16) if geo.group_dtype(group) == "bfloat16" else arr


def run_dest(geo: Geometry, group: int, n: int) -> tuple[mx.array, list[np.ndarray]]:
    """One array for ``n`` consecutive pages of ``group`` ``[layers, 2, kv_heads, n * page_size,
    head_dim]`` (storage dtype), and per page the writable byte view its file's data fills: one
    row per layer, key/value and head, of ``page_size x head_dim`` items (the file's order)."""
    mdt = storage_dtype(geo, group)
    shape = geo.shape(geo.page_size * n, group)
    arr = new_array(shape, mdt)
    block = geo.page_size * shape[-1] * mdt.size
    rows = np.array(arr, copy=False).view(np.uint8).reshape(-1, n * block)
    return arr, [rows[:, i * block : (i + 1) * block] for i in range(n)]


_staging = threading.local()  # per reader thread: a page file's bytes, for a page in a run


def staging(size: int) -> np.ndarray:
    """This thread's buffer that page files are read whole into, of at least ``size`` bytes."""
    stage = getattr(_staging, "buf", None)
    if stage is None or stage.nbytes < size:
        stage = _staging.buf = np.empty(size, dtype=np.uint8)
    return stage


def fill_page(fd: int, size: int, dest: memoryview | np.ndarray, head_sum: bytes,
              data_sum: str) -> bool:
    """Read a page file of ``size`` bytes into ``dest`` (its data: the file's last bytes) and say
    whether it is still the file a store indexed: its header's bytes hash to ``head_sum`` and
    its data to ``data_sum`` (the header was checked in full when the store wrote or indexed the
    file). ``dest`` is contiguous memory (read straight into) or a page's strided rows in a run
    (``run_dest``): the file is then read whole into this thread's staging buffer, checked there
    and copied in one pass (hashing the rows in place one by one costs more than the copy)."""
    nbytes = dest.nbytes
    if size <= nbytes:
        return False
    if isinstance(dest, memoryview):
        head = bytearray(size - nbytes)
        read_into(fd, [memoryview(head), dest], 0)  # one read: header and data
        return head_digest(head) == head_sum and checksum(dest) == data_sum
    stage = staging(size)
    whole = memoryview(stage)[:size]
    read_into(fd, whole, 0)
    if head_digest(whole[: size - nbytes]) != head_sum or checksum(whole[size - nbytes :]) != data_sum:
        return False
    dest[...] = stage[size - nbytes : size].reshape(dest.shape)
    return True


def to_array(view: np.ndarray, dtype: str) -> mx.array:
    """Storage-form data (``check_page``) as an MLX array (one copy)."""
    arr = mx.array(view)
    return arr.view(mx.bfloat16) if DTYPES[dtype][0] == mx.bfloat16 else arr


def decode_page(geo: Geometry, buf: bytes, expect: bytes, kind: str = PAGE_FORMAT) -> mx.array:
    """A whole page (or tail) file, every check passed, to its data."""
    return to_array(*check_page(geo, buf, expect, kind))


def decode_entry(geo: Geometry, buf: bytes) -> tuple[EntryMetaInfo, dict[str, mx.array]]:
    """A whole manifest, every check passed, to its metadata and tensors (its state)."""
    h = parse_header(buf, len(buf))
    info = parse_entry(geo, h)
    return info, _entry_tensors(geo, h, buf)


def _entry_tensors(geo: Geometry, h: Header, buf: bytes) -> dict[str, mx.array]:
    _verified(h, buf)
    st = geo.state_tensors()
    return {name: from_storage(buf, t.start, t.shape, st[name][1]) for name, t in h.tensors.items()}


def decode_known_entry(geo: Geometry, buf: bytes, head_sum: bytes) -> dict[str, mx.array] | None:
    """The tensors (recurrent state) of a whole manifest whose header's bytes hash to
    ``head_sum`` (checked in full when it was written or indexed), their checksum verified;
    None when the header is not that one."""
    h = parse_header(buf, len(buf))
    if head_digest(memoryview(buf)[: h.data_start]) != head_sum:
        return None
    return _entry_tensors(geo, h, buf)


def read_header(fd: int, size: int) -> Header:
    """The header of an open file; reads exactly its bytes, never the tensor data."""
    head = read_at(fd, 8, 0) if size >= 8 else b""
    if len(head) < 8:
        raise FormatError(f"truncated: {size} bytes")
    (n,) = struct.unpack("<Q", head)
    if 2 <= n <= MAX_HEADER_BYTES and 8 + n <= size:
        head += read_at(fd, n, 8)
    h = parse_header(head, size)
    return Header(h.size, h.data_start, h.metadata, h.tensors, head_digest(head))
