"""What one sequence reads at one layer (``kv_cache.model.reads``): its own keys and values
stretched to a group's length."""

from __future__ import annotations

import mlx.core as mx

from kv_cache.model.reads import Reads, pad


def test_pad_adds_zeros_along_the_axis_and_leaves_a_full_array_alone():
    a = mx.ones((1, 2, 3, 4))
    assert pad(a, 3) is a
    got = pad(a, 5)
    assert got.shape == (1, 2, 5, 4) and mx.array_equal(got[:, :, :3], a).item()
    assert not mx.any(got[:, :, 3:]).item()
    assert pad(a, 6, -1).shape == (1, 2, 3, 6)


def test_padded_reads_a_longer_slice_of_its_buffers_or_pads_with_zeros():
    buf = mx.arange(10, dtype=mx.float32).reshape(1, 1, 10, 1)
    keys = buf[..., 2:5, :]
    r = Reads(None, None, keys, keys, 0, 0, 0, buffer=(buf, buf), at=2)
    k, v = r.padded(3)
    assert k is keys and v is keys
    k, _ = r.padded(6)  # the buffers go on past the keys: their next positions, no zeros
    assert k[0, 0, :, 0].tolist() == [2, 3, 4, 5, 6, 7]
    k, _ = r.padded(9)  # past the buffers' end: zeros
    assert k[0, 0, :, 0].tolist() == [2, 3, 4, 0, 0, 0, 0, 0, 0]
