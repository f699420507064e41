"""The disk store's file format: safetensors files with self-describing metadata, written
atomically and read defensively.

A file is standard safetensors (an 8-byte little-endian header length, a JSON header, the tensor
bytes), readable by ``mx.load`` and the ``safetensors`` package; bfloat16 is stored as ``BF16``.
The header's ``__metadata__`` (strings only) says what the file is and for which model:

    format          "mlx-kvcache-page", "mlx-kvcache-tail" or "mlx-kvcache-entry"
    format_version  FORMAT_VERSION ("4")
    fingerprint, page_size
    cache_spec      the model's cache spec as canonical JSON (``kv_cache.layout.spec``): its paged groups
                    (kind, layers, heads, head size, dtype, window) and recurrent-state slots
    tokens          JSON list of token ids
    page:   group, hash, parent (hex; hash == page_hash(parent, tokens, extras), in that group's
            chain), extras (only for a page that holds an image's tokens: JSON [[image hash,
            offset into the image at the page's start, its length], ...], ``pages.spans``);
            tensor "kv" [group layers, 2, H, P, D] in the group's dtype
    tail:   a partial page, as a page but with 1..P-1 tokens (hash == page_hash(parent,
            tokens, extras) too) and tensor "kv" [group layers, 2, H, tokens, D]
    entry:  key (the message id, only here), page_hashes (JSON list of hex, every group's pages
            one group after another), layout (JSON [[skip, count], ...] per group: the first
            ``skip`` full pages are not stored, as no sliding window at the entry's end reads
            them, then ``count`` pages), tail_tokens, state ("1" when the entry carries the
            recurrent state after its tokens), spans (only for an entry with images: JSON
            [[start, length, image hash], ...]; its pages chain over them); tensors
            "state.<slot>.<i>" per recurrent-state array. An entry's open tail page (its last
            tail_tokens tokens, per group) is not in the manifest: it is the first tail_tokens
            positions of any stored page or tail whose parent is the entry's last full page's
            chain hash (the group's root when there is none) and whose tokens (and image keys)
            over them are the entry's tail's
    data_checksum   xxh3-128 of the tensor bytes (checked when data is loaded)
    meta_checksum   xxh3-128 of the canonical JSON of every other metadata field

The checksums detect corruption (torn writes, flipped bits, truncation); they are not
authentication. Page identity is the page hash (sha256 chain, ``kv_cache.pages.hashing``), checked
against the tokens in the header.

Files with images say so in the optional ``extras`` and ``spans``, which a file of text has not:
a text page or entry is byte for byte what it was before images, so they need no new version.
Version 4 (this one) stores an entry's open tail page once, as a content-addressed partial page
(a "tail" file) that every entry ending inside that page shares, each with its own length, and
that a longer tail or the full page continuing it replaces; version 3 kept a copy of the tail in
every manifest. Version 3 checks with xxh3-128 instead of version 2's blake2b-256: xxh3 runs at
memory speed (~19 GB/s here against ~0.9 GB/s), so verifying is no longer what limits a
restore. Version 2 replaced version 1's one page shape (dtype, num_layers, num_kv_heads,
head_dim) by the cache spec, and added page groups, entry layouts and state snapshots. Files of
another version are foreign: a miss, logged and removed.

The safetensors framing (written by us, every header checked against the file's size before
any tensor byte is touched) is ``framing``; this module says what the metadata must say and
builds the files; reading their data into MLX arrays is ``file_data``. The tests read the files
back with ``mx.load`` and ``safetensors.safe_open``. ``FormatError`` is a file that is not a
valid file of ours; ``ForeignError`` a valid one for another model, geometry or format version.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np
import xxhash

from kv_cache.errors import ForeignError, FormatError  # noqa: F401 - the format's errors
from kv_cache.layout.spec import CacheSpec
from kv_cache.pages.hashing import chain_hashes, page_hash, root_hash
from kv_cache.pages.spans import Extra, Span, as_spans
from kv_cache.tiers.disk.framing import Header, encode
from kv_cache.tiers.disk.framing import read_header  # noqa: F401 - reads a file's header

FORMAT_VERSION = "4"
PAGE_FORMAT = "mlx-kvcache-page"
TAIL_FORMAT = "mlx-kvcache-tail"
ENTRY_FORMAT = "mlx-kvcache-entry"
INT64 = (-(1 << 63), 1 << 63)

# store dtype name -> (mx dtype, safetensors code, numpy storage dtype)
DTYPES: dict[str, tuple[mx.Dtype, str, np.dtype]] = {
    "float16": (mx.float16, "F16", np.dtype("<f2")),
    "bfloat16": (mx.bfloat16, "BF16", np.dtype("<u2")),  # numpy has no bf16: raw 16-bit words
    "float32": (mx.float32, "F32", np.dtype("<f4")),
    "uint32": (mx.uint32, "U32", np.dtype("<u4")),  # pages in bits (kv_cache.layout.quant)
}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_UINT = re.compile(r"[0-9]{1,9}")


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

    def root(self, group: int = 0) -> bytes:
        return root_hash(self.fingerprint, group)

    def shape(self, n: int, group: int = 0) -> list[int]:
        """A page's data as stored (in bits: the codec's words, ``GroupSpec.stored_shape``)."""
        return list(self.spec.groups[group].stored_shape(n))

    def group_dtype(self, group: int) -> str:
        return self.spec.groups[group].stored_dtype

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


def meta_checksum(meta: dict[str, str]) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_checksum"}
    return checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def seal_metadata(meta: dict[str, str]) -> dict[str, str]:
    meta["meta_checksum"] = meta_checksum(meta)
    return meta


def page_metadata(geo: Geometry, h: bytes, parent: bytes, tokens: Sequence[int],
                  data_sum: str, group: int = 0, kind: str = PAGE_FORMAT,
                  extras: Sequence[Extra] = ()) -> dict[str, str]:
    meta = {"format": kind, **geo.metadata(), "group": str(group), "hash": h.hex(),
            "parent": parent.hex(), "tokens": json.dumps(list(tokens)),
            "data_checksum": data_sum}
    if extras:  # NOTE: a text page's file says nothing of images: as before them
        meta["extras"] = json.dumps([list(e) for e in extras])
    return seal_metadata(meta)


def entry_metadata(geo: Geometry, key: str, tokens: Sequence[int], hashes: Sequence[bytes],
                   tail_tokens: int, data_sum: str, layout: Sequence[tuple[int, int]],
                   state: bool, spans: Sequence[Span] = ()) -> dict[str, str]:
    meta = {"format": ENTRY_FORMAT, **geo.metadata(), "key": key,
            "tokens": json.dumps(list(tokens)),
            "page_hashes": json.dumps([h.hex() for h in hashes]),
            "layout": json.dumps([list(x) for x in layout]),
            "tail_tokens": str(tail_tokens), "state": "1" if state else "0",
            "data_checksum": data_sum}
    if spans:
        meta["spans"] = json.dumps([list(s) for s in spans])
    return seal_metadata(meta)


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


def _spans(meta: dict[str, str]) -> tuple[Span, ...]:
    """An entry's image spans (none where the metadata names none: a text entry)."""
    if "spans" not in meta:
        return ()
    got = _json(meta, "spans")
    try:
        if not isinstance(got, list):
            raise ValueError
        return as_spans(got)
    except ValueError:
        raise FormatError("metadata 'spans' is not a list of image spans") from None


def _extras(meta: dict[str, str]) -> tuple[Extra, ...]:
    """A page's extra keys (none where the metadata names none: a text page)."""
    if "extras" not in meta:
        return ()
    got = _json(meta, "extras")
    if not (isinstance(got, list) and got and all(
            isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and e[0]
            and all(type(v) is int and INT64[0] <= v < INT64[1] for v in e[1:]) and e[2] > 0
            for e in got)):
        raise FormatError("metadata 'extras' is not a list of a page's image keys")
    return tuple((e[0], e[1], e[2]) for e in got)


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
    extras: tuple[Extra, ...] = ()  # its image keys (``kv_cache.pages.spans.page_extras``)


def parse_page(geo: Geometry, h: Header, expect: bytes, kind: str = PAGE_FORMAT) -> PageMetaInfo:
    """A page's header (``kind``: a full page, or a partial page of 1..P-1 tokens)."""
    meta = check_common(geo, h, kind)
    group = _uint(meta, "group")
    if group >= len(geo.spec.groups):
        raise FormatError("a page of no group of this model")
    ph, parent = _hex(meta.get("hash"), "hash"), _hex(meta.get("parent"), "parent")
    tokens, extras = _tokens(meta), _extras(meta)
    n = len(tokens)
    if not (n == geo.page_size if kind == PAGE_FORMAT else 0 < n < geo.page_size) \
            or page_hash(parent, tokens, extras) != ph or ph != expect:
        raise FormatError("page hash does not match its tokens, parent or file name")
    _check_tensors(h, {"kv": (geo.shape(n, group), geo.group_dtype(group))}, "page")
    return PageMetaInfo(ph, parent, tokens, group, str(meta.get("data_checksum", "")), extras)


@dataclass(frozen=True, slots=True)
class EntryMetaInfo:
    key: str
    tokens: tuple[int, ...]
    page_hashes: list[bytes]
    tail_tokens: int
    layout: tuple[tuple[int, int], ...] = ()
    has_state: bool = False
    tail_parents: tuple[bytes, ...] = ()  # per group, the parent of its open tail page (if any)
    spans: tuple[Span, ...] = ()  # the image spans among its tokens


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
    at, parents, spans = 0, [], _spans(meta)
    for g, (skip, count) in enumerate(layout):
        if skip and groups[g].kind.reads_all:
            raise FormatError("a full-attention group skips pages")
        chain = chain_hashes(geo.root(g), tokens, P, spans=spans)
        if chain[skip:] != hashes[at : at + count]:
            raise FormatError("entry page hashes do not match its tokens")
        at += count
        parents.append(chain[-1] if chain else geo.root(g))
    has_state = meta["state"] == "1"
    _check_tensors(h, geo.state_tensors() if has_state else {}, "entry")
    return EntryMetaInfo(key, tokens, hashes, tail, tuple(tuple(x) for x in layout), has_state,
                         tuple(parents) if tail else (), spans)


def page_file(geo: Geometry, h: bytes, parent: bytes, tokens: Sequence[int],
              data: mx.array, group: int = 0,
              extras: Sequence[Extra] = ()) -> tuple[list, str]:
    """A sealed page's file (or, with fewer than page_size tokens, a tail file) with its image
    keys ``extras``, as chunks to write, and its data's checksum."""
    dt = geo.group_dtype(group)
    arr = to_storage(data, dt)
    kind = PAGE_FORMAT if len(tokens) == geo.page_size else TAIL_FORMAT
    data_sum = checksum(arr)
    meta = page_metadata(geo, h, parent, tokens, data_sum, group, kind, extras)
    return encode({"kv": arr}, DTYPES[dt][1], meta), data_sum


def entry_file(geo: Geometry, key: str, tokens: Sequence[int], hashes: Sequence[bytes],
               layout: Sequence[tuple[int, int]] | None = None,
               state: Sequence[Sequence[mx.array | np.ndarray]] | None = None,
               spans: Sequence[Span] = ()) -> list:
    """An entry's manifest (with its recurrent state and its image ``spans``), as chunks to
    write. ``layout``: per group (skip, count), default all pages of one group. Its open tail
    page is stored apart (a page or tail file that holds it)."""
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
                          checksum(*tensors.values()), layout, state is not None, spans)
    return encode(tensors, codes, meta)
