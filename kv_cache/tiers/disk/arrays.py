"""The disk store's keyed arrays: a key's named arrays (whatever a user keeps by a key of its
own, recomputable but costly: the store knows nothing of what they are) in one file,
``arrays/<sha256(key) hex>.safetensors``, counted in the store's byte budget and evicted in
policy order with its entries (``StoreIndex``).

A file is safetensors as the store's others (``file_format``): its metadata says
``format`` "mlx-kvcache-arrays", the store's geometry (a file of another model is foreign), the
``key`` (only here: the name is its hash, docs/ARCHITECTURE.md invariant 7) and the checksums
of its metadata and data. Each array keeps its dtype, so what is read back is bit for bit what
was written. A file is written once (temp file, fsync, rename) and never changed; a read checks
it whole, and a bad one is a miss, logged and removed.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Mapping

import mlx.core as mx
import numpy as np

from kv_cache.errors import FormatError
from kv_cache.tiers.disk import atomic_fs as afs
from kv_cache.tiers.disk import file_format as fmt
from kv_cache.tiers.disk import framing
from kv_cache.tiers.disk.index import StoreIndex, entry_name

log = logging.getLogger("kv_cache.tiers.disk.store")

ARRAYS_FORMAT = "mlx-kvcache-arrays"
ARRAYS_NAME = re.compile(r"[0-9a-f]{64}\.safetensors")
MAX_ARRAYS = 64  # named arrays one key may keep
# mx dtype -> (safetensors code, numpy storage dtype); bfloat16 kept as its raw 16-bit words
ARRAY_DTYPES: dict[mx.Dtype, tuple[str, np.dtype]] = {
    mx.float16: ("F16", np.dtype("<f2")), mx.bfloat16: ("BF16", np.dtype("<u2")),
    mx.float32: ("F32", np.dtype("<f4")), mx.int32: ("I32", np.dtype("<i4")),
    mx.uint32: ("U32", np.dtype("<u4")), mx.int64: ("I64", np.dtype("<i8")),
    mx.int16: ("I16", np.dtype("<i2")), mx.uint16: ("U16", np.dtype("<u2")),
    mx.int8: ("I8", np.dtype("i1")), mx.uint8: ("U8", np.dtype("u1")),
    mx.bool_: ("BOOL", np.dtype("?"))}
_BY_CODE = {code: (dt, np_dt) for dt, (code, np_dt) in ARRAY_DTYPES.items()}

# what crosses to the writer thread: per name, the array's storage bytes and its safetensors code
HostArrays = dict[str, tuple[np.ndarray, str]]


def host_arrays(arrays: Mapping[str, mx.array]) -> HostArrays:
    """``arrays`` as host bytes in storage form, evaluated here (the writer never runs MLX);
    ``ValueError`` for a dtype a file cannot keep or too many arrays."""
    if not 0 < len(arrays) <= MAX_ARRAYS:
        raise ValueError(f"between 1 and {MAX_ARRAYS} arrays are kept under a key")
    out = {}
    for name, a in arrays.items():
        if a.dtype not in ARRAY_DTYPES:
            raise ValueError(f"arrays of dtype {a.dtype} are not kept on disk")
        code, np_dt = ARRAY_DTYPES[a.dtype]
        a = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
        mx.eval(a)
        host = np.ascontiguousarray(np.asarray(a), dtype=np_dt).reshape(a.shape)  # 0-d kept
        out[str(name)] = (host, code)
    return out


def arrays_file(geo: fmt.Geometry, key: str, arrays: HostArrays) -> list:
    """The file of ``key``'s ``arrays``, as chunks to write."""
    tensors = {name: arr for name, (arr, _) in arrays.items()}
    meta = fmt.seal_metadata({"format": ARRAYS_FORMAT, **geo.metadata(), "key": key,
                              "data_checksum": fmt.checksum(*tensors.values())})
    return framing.encode(tensors, {name: code for name, (_, code) in arrays.items()}, meta)


def parse_arrays(geo: fmt.Geometry, h: framing.Header, name: str) -> str:
    """The key of an arrays file's header, checked against the store and the file's name."""
    meta = fmt.check_common(geo, h, ARRAYS_FORMAT)
    key = meta.get("key")
    if not isinstance(key, str) or entry_name(key) != name:
        raise FormatError("an arrays file named for another key")
    if not 0 < len(h.tensors) <= MAX_ARRAYS or any(t.dtype not in _BY_CODE
                                                    for t in h.tensors.values()):
        raise FormatError("an arrays file's tensors are not ones it keeps")
    return key


def decode_arrays(geo: fmt.Geometry, buf: bytes, name: str) -> tuple[str, dict[str, mx.array]]:
    """A whole arrays file, every check passed, to its key and arrays."""
    h = framing.parse_header(buf, len(buf))
    key = parse_arrays(geo, h, name)
    spans = [memoryview(buf)[t.start : t.end] for t in h.tensors.values()]
    if fmt.checksum(*spans) != h.metadata.get("data_checksum"):
        raise FormatError("data checksum mismatch")
    out = {}
    for tname, t in h.tensors.items():
        dt, np_dt = _BY_CODE[t.dtype]
        count = int(np.prod(t.shape)) if t.shape else 1
        arr = mx.array(np.frombuffer(buf, dtype=np_dt, count=count, offset=t.start)
                       .reshape(t.shape))
        out[tname] = arr.view(mx.bfloat16) if dt == mx.bfloat16 else arr
    return key, out


class ArrayFiles:
    """The keyed arrays files of a store's ``index`` (its folders: ``index.dirs``), used under
    the store's lock."""

    def __init__(self, index: StoreIndex):
        self.index, self.geo = index, index.geo
        self.fd = index.dirs.arrays_fd

    def has(self, key: str) -> bool:
        return entry_name(key) in self.index.arrays

    def put(self, key: str, arrays: HostArrays) -> bool:
        """Write ``key``'s arrays (once: a key already kept is only touched), evicting entries
        and other keys' arrays in policy order to keep within the budget. False (logged,
        counted as refused or as an error) when it does not fit or the disk refuses."""
        ix, name = self.index, entry_name(key)
        if name in ix.arrays:
            self.touch(key)
            return True
        chunks = arrays_file(self.geo, key, arrays)
        add = framing.nbytes(chunks)
        if not ix.fits_after_evicting_all(None, (), set(), add):
            ix.counts.refused += 1
            return False
        try:
            while ix.nbytes + add > ix.max_bytes:
                if not ix.evict_one(()):
                    raise OSError("cannot remove the files of evicted entries")
            size = afs.atomic_write(self.fd, name, chunks, mtime_ns=ix.tick())
        except OSError as e:
            ix.counts.errors += 1
            log.warning("disk store: could not save a key's arrays: %s", e)
            return False
        ix.add_arrays(name, size)
        return True

    def load(self, key: str) -> dict[str, mx.array] | None:
        """``key``'s arrays read and checked (it becomes the most recently used); None when
        the store has none, or the file is gone or bad (logged, removed)."""
        ix, name = self.index, entry_name(key)
        if name not in ix.arrays:
            return None
        try:
            fd, size = afs.open_regular(name, self.fd)
            try:
                buf = afs.read_all(fd, size)
            finally:
                os.close(fd)
            got_key, arrays = decode_arrays(self.geo, buf, name)
            if got_key != key:
                raise FormatError("the arrays of another key")
        except (FormatError, OSError) as err:
            if ix.bad_file(err, self.fd, name, "arrays"):
                ix.forget_arrays(name)
            return None
        self.touch(key)
        return arrays

    def touch(self, key: str) -> None:
        """``key``'s arrays become the most recently used (persisted as the file's mtime)."""
        ix, name = self.index, entry_name(key)
        if ix.touch_arrays(name):
            t = ix.tick()
            try:
                os.utime(name, ns=(t, t), dir_fd=self.fd, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass  # recency only

    def scan(self) -> list[tuple[int, str, int]]:
        """``(mtime, name, size)`` of every arrays file whose header checks (bad and temp
        files removed on the way), for the start-up scan to index in recency order."""
        ix, out = self.index, []
        try:
            items = list(os.scandir(self.fd))
        except OSError as e:
            log.warning("disk store: cannot list the arrays folder: %s", e)
            return []
        for f in items:
            if f.name.startswith(afs.TMP_PREFIX):
                ix.counts.temp_files_removed += afs.unlink(self.fd, f.name)
                continue
            if not ARRAYS_NAME.fullmatch(f.name):
                continue
            try:
                fd, size = afs.open_regular(f.name, self.fd)
                try:
                    parse_arrays(self.geo, framing.read_header(fd, size), f.name)
                    mtime = os.fstat(fd).st_mtime_ns
                finally:
                    os.close(fd)
            except (FormatError, OSError) as err:
                ix.bad_file(err, self.fd, f.name, "arrays")
                continue
            out.append((mtime, f.name, size))
        return out
