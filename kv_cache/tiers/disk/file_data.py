"""Reading the data of the disk store's files: whole page, tail and entry files checked and
decoded, and page files read straight into the memory of MLX arrays.

A restore reads many pages, so a page's data goes from the file into the array that holds it
with no copy between (``page_dests``, ``fill_page``), or, for consecutive pages of a group, into
their rows of one array (``run_dest``; ``kv_cache.pages.runs``). Numpy, through which files are
read, has no bfloat16: such pages are read as raw 16-bit words and viewed back (``as_page``).
Nothing here runs MLX but the allocation of the arrays and the final views, so the reading and
checking is safe on a reader thread.
"""

from __future__ import annotations

import threading
from typing import Sequence

import mlx.core as mx
import numpy as np

from kv_cache.pages.memory import new_array
from kv_cache.tiers.disk import file_format as fmt
from kv_cache.tiers.disk import framing
from kv_cache.tiers.disk.atomic_fs import read_into
from kv_cache.tiers.disk.file_format import DTYPES, FormatError, Geometry
from kv_cache.tiers.disk.framing import Header, head_digest

def _verified(h: Header, buf: bytes) -> None:
    spans = [memoryview(buf)[t.start : t.end] for t in h.tensors.values()]
    if fmt.checksum(*spans) != h.metadata.get("data_checksum"):
        raise FormatError("data checksum mismatch")


def check_page(geo: Geometry, buf, expect: bytes,
               kind: str = fmt.PAGE_FORMAT) -> tuple[np.ndarray, str]:
    """A whole page (or tail) file, every check passed: its data as a zero-copy numpy view of
    ``buf`` (storage form) and its dtype name. Runs no MLX (safe in a reader thread)."""
    h = framing.parse_header(buf, len(buf))
    fmt.parse_page(geo, h, expect, kind)
    _verified(h, buf)
    t = h.tensors["kv"]
    dt = geo.group_dtype(int(h.metadata["group"]))
    view = np.frombuffer(buf, dtype=DTYPES[dt][2], count=int(np.prod(t.shape)), offset=t.start)
    return view.reshape(t.shape), dt


def page_dests(geo: Geometry, groups: Sequence[int]) -> list[tuple[mx.array, memoryview]]:
    """Per page of ``groups``, an MLX array for it and a writable byte view of its memory, for
    reading a page file straight into it (``fill_page``; ``as_page`` once filled). One
    evaluation for all: cheaper per page."""
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
        return head_digest(head) == head_sum and fmt.checksum(dest) == data_sum
    stage = staging(size)
    whole = memoryview(stage)[:size]
    read_into(fd, whole, 0)
    if head_digest(whole[: size - nbytes]) != head_sum \
            or fmt.checksum(whole[size - nbytes :]) != data_sum:
        return False
    dest[...] = stage[size - nbytes : size].reshape(dest.shape)
    return True


def to_array(view: np.ndarray, dtype: str) -> mx.array:
    """Storage-form data (``check_page``) as an MLX array (one copy)."""
    arr = mx.array(view)
    return arr.view(mx.bfloat16) if DTYPES[dtype][0] == mx.bfloat16 else arr


def decode_page(geo: Geometry, buf: bytes, expect: bytes,
                kind: str = fmt.PAGE_FORMAT) -> mx.array:
    """A whole page (or tail) file, every check passed, to its data."""
    return to_array(*check_page(geo, buf, expect, kind))


def decode_entry(geo: Geometry, buf: bytes) -> tuple[fmt.EntryMetaInfo, dict[str, mx.array]]:
    """A whole manifest, every check passed, to its metadata and tensors (its state)."""
    h = framing.parse_header(buf, len(buf))
    info = fmt.parse_entry(geo, h)
    return info, _entry_tensors(geo, h, buf)


def _entry_tensors(geo: Geometry, h: Header, buf: bytes) -> dict[str, mx.array]:
    _verified(h, buf)
    st = geo.state_tensors()
    return {name: fmt.from_storage(buf, t.start, t.shape, st[name][1]) for name, t in h.tensors.items()}


def decode_known_entry(geo: Geometry, buf: bytes, head_sum: bytes) -> dict[str, mx.array] | None:
    """The tensors (recurrent state) of a whole manifest whose header's bytes hash to
    ``head_sum`` (checked in full when it was written or indexed), their checksum verified;
    None when the header is not that one."""
    h = framing.parse_header(buf, len(buf))
    if head_digest(memoryview(buf)[: h.data_start]) != head_sum:
        return None
    return _entry_tensors(geo, h, buf)
