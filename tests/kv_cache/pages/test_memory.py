"""kv_cache.pages.memory: new MLX arrays written once by the caller (no zero fill first)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.pages import memory as mx_memory
from kv_cache.pages.memory import empty, new_array

SHAPES = [(), (3,), (0, 5), (2, 3, 4), (2, 2, 3, 16, 8)]
DTYPES = [mx.uint8, mx.uint16, mx.float16, mx.float32, mx.int32, mx.bfloat16]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_empty_array_has_its_shape_and_dtype_and_takes_writes_in_place(shape, dtype):
    a = empty(shape, dtype)
    assert a.shape == shape and a.dtype == dtype
    raw = a.view(mx.uint16) if dtype == mx.bfloat16 else a
    host = np.array(raw, copy=False)  # the array's own memory, as a restore fills it
    assert host.flags.writeable and host.shape == shape
    want = np.arange(host.size, dtype=np.int64).reshape(shape) % 7 + 1
    if dtype == mx.bfloat16:
        host[...] = np.array(mx.array(want.astype(np.float32)).astype(mx.bfloat16)
                             .view(mx.uint16))
    else:
        host[...] = want.astype(host.dtype)
    assert np.array_equal(np.array(a.astype(mx.float32)), want.astype(np.float32))
    assert mx.array_equal(a * 2, mx.array(want * 2).astype(dtype)).item()  # MLX ops see them


def test_empty_arrays_are_separate_memory():
    a, b = empty((1000,), mx.int32), empty((1000,), mx.int32)
    np.array(a, copy=False)[:] = 1
    np.array(b, copy=False)[:] = 2
    assert a.sum().item() == 1000 and b.sum().item() == 2000


def test_a_dtype_npy_cannot_name_is_refused():
    with pytest.raises(TypeError, match="uninitialised"):
        empty((2,), mx.complex64)


def test_new_array_fills_nothing_from_the_threshold_on(monkeypatch):
    def no_zeros(*a, **k):
        raise AssertionError("zero-filled")

    monkeypatch.setattr(mx_memory.mx, "zeros", no_zeros)
    big = new_array((mx_memory.EMPTY_MIN_BYTES // 2,), mx.uint16)  # exactly the threshold
    assert big.shape == (mx_memory.EMPTY_MIN_BYTES // 2,) and big.dtype == mx.uint16
    with pytest.raises(AssertionError, match="zero-filled"):
        new_array((16,), mx.uint16)  # below it: zeros (the allocator's reused memory is cheaper)
    monkeypatch.undo()
    small = new_array((16,), mx.uint16)
    assert small.sum().item() == 0
