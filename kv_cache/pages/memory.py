"""New MLX arrays whose memory is written once, by the caller.

A restore reads page files straight into the memory of new MLX arrays (through the buffer
protocol). ``mx.zeros`` would fill that memory first: on a CPU that fill is most of a restore's
time (measured on the Linux CPU backend: 105 MB zero-filled in ~36 ms, against ~12 ms to read
and check the files). MLX has no ``empty``; its ``load`` does what one needs: it allocates the
array and reads the file's data straight into it. ``empty`` hands ``mx.load`` a file-like object
that serves an ``.npy`` header and leaves the data bytes as the allocator gave them, so the
caller's reads are the memory's first writes. Never expose such an array before every byte of
it has been written."""

from __future__ import annotations

import io
import math
import sys
from typing import Sequence

import mlx.core as mx

_ORDER = "<" if sys.byteorder == "little" else ">"  # native: MLX swaps no bytes
_DESCR = {mx.uint8: "|u1", mx.int8: "|i1", mx.uint16: _ORDER + "u2", mx.int16: _ORDER + "i2",
          mx.float16: _ORDER + "f2", mx.uint32: _ORDER + "u4", mx.int32: _ORDER + "i4",
          mx.float32: _ORDER + "f4"}


# From this size on, ``empty`` and then one write cost less than ``mx.zeros`` and a write
# (measured on the Linux CPU backend, allocation and one numpy write of every byte, medians:
# 512 KiB 0.13 against 0.15 ms, 8 MiB 0.50 against 1.33, 32 MiB 3.1 against 7.9; 64 KiB 0.11
# against 0.07: below it ``mx.load``'s fixed cost of a call is the larger one).
EMPTY_MIN_BYTES = 512 << 10


def new_array(shape: Sequence[int], dtype: mx.Dtype) -> mx.array:
    """An evaluated array to be written in full by the caller: ``empty`` when large, else zeros."""
    if math.prod(int(d) for d in shape) * dtype.size >= EMPTY_MIN_BYTES:
        return empty(shape, dtype)
    arr = mx.zeros(shape, dtype=dtype)
    mx.eval(arr)
    return arr


def empty(shape: Sequence[int], dtype: mx.Dtype) -> mx.array:
    """An evaluated, row-contiguous array of ``shape`` and ``dtype`` whose contents are whatever
    the allocator's memory held (write all of it through ``np.array(a, copy=False)``)."""
    if dtype == mx.bfloat16:  # npy has no bfloat16: raw 16-bit words, viewed without a copy
        return empty(shape, mx.uint16).view(mx.bfloat16)
    if dtype not in _DESCR:
        raise TypeError(f"no uninitialised allocation for {dtype}")
    shape = tuple(int(d) for d in shape)
    arr = mx.load(_Unwritten(shape, _DESCR[dtype], dtype.size), format="npy")
    mx.eval(arr)
    return arr


class _Unwritten(io.RawIOBase):
    """An ``.npy`` file whose data bytes are never written: reading them leaves the reader's
    buffer (the new array's memory) as it was."""

    def __init__(self, shape: tuple[int, ...], descr: str, itemsize: int):
        dims = "".join(f"{d}, " for d in shape) if len(shape) != 1 else f"{shape[0]},"
        text = "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }" % (descr, dims.rstrip(" "))
        pad = -(10 + len(text) + 1) % 64  # the format's alignment: header ends on 64 bytes
        text = text + " " * pad + "\n"
        self._head = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode()
        self._size = len(self._head) + math.prod(shape) * itemsize
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        end = min(self._pos + view.nbytes, self._size)
        head = self._head[self._pos : end]
        view[: len(head)] = head  # the data's bytes are left as they are
        n = max(0, end - self._pos)
        self._pos = end
        return n
