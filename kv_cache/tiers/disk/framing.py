"""The safetensors framing of the disk store's files, written by us and read defensively.

A safetensors file is an 8-byte little-endian header length, a JSON header (``__metadata__``, a
map of strings, and per tensor its dtype code, shape and data offsets) and the tensor bytes.
This module writes that framing itself around raw little-endian bytes (numpy has no bfloat16
and the ``safetensors`` writer's API changed in 0.8) and checks every header it reads against
the file's size before any tensor byte is touched: header length, JSON, offsets, dtypes and
sizes. What the metadata must say is ``file_format``'s business.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import xxhash

from kv_cache.errors import FormatError
from kv_cache.tiers.disk.atomic_fs import read_at

MAX_HEADER_BYTES = 16 << 20  # hostile-header cap
# Every safetensors dtype code and its item size (structural check of any header).
ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


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


def nbytes(chunks: Sequence) -> int:
    """The bytes of a file given as chunks (``encode``)."""
    return sum(memoryview(c).nbytes for c in chunks)


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
