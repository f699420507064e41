"""The page codec: MLX's affine layout, a round trip that is exactly dequantize(quantize(x)) and
a projection (applied twice it changes nothing, bit for bit: what a layer reads of a fresh key is
what its page gives back), sizes, and the settings' description."""

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.layout.quant import KVQuant, make_quant

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
SETTINGS = [(8, 64), (8, 32), (4, 64), (4, 32), (4, 128), (8, 128)]


def kv_like(shape, dtype, seed=0) -> mx.array:
    """Keys-like rows: Gaussian, per-row scales over four decades and offsets, plus the corner
    cases of a row: all zeros, constant, tiny, one outlier, a large offset with a tiny spread."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape) * np.exp(rng.normal(size=shape[:-1] + (1,)) * 2)
    x += rng.normal(size=shape[:-1] + (1,)) * 10
    flat = x.reshape(-1, shape[-1])
    flat[0] = 0
    flat[1] = 3.0
    flat[2] = 1e-6
    flat[3, :5] = 1000.0
    flat[4] = 100.0 + rng.normal(size=shape[-1]) * 1e-3
    flat[5] = -flat[4]
    return mx.array(np.clip(x, -6e4, 6e4).astype(np.float32)).astype(dtype)


def same_bits(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape \
        and bool(mx.all(a.view(mx.uint16 if a.dtype.size == 2 else mx.uint32)
                        == b.view(mx.uint16 if b.dtype.size == 2 else mx.uint32)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group", SETTINGS)
def test_round_trip_is_dequantize_of_quantize_and_a_projection(bits, group, dtype):
    q = KVQuant(bits, group)
    x = kv_like((3, 2, 2, 40, 128), dtype)
    y = q.round_trip(x)
    assert same_bits(y, q.dequantize(q.quantize(x)))
    assert same_bits(q.round_trip(y), y)
    # what a page stores of the round-tripped values gives them back exactly
    assert same_bits(q.dequantize(q.quantize(y)), y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_pair_equals_two_round_trips(dtype):
    q = KVQuant(8)
    k, v = kv_like((1, 3, 5, 64), dtype, 1), kv_like((1, 3, 5, 64), dtype, 2)
    rk, rv = q.round_trip_pair(k, v)
    assert same_bits(rk, q.round_trip(k)) and same_bits(rv, q.round_trip(v))


def test_mx_quantize_is_not_a_projection_here():
    """Why the codec picks its own (power-of-two) scales: MLX's own round trip, applied to its
    output, moves values (if MLX ever changes this, the note in quant.py is stale)."""
    x = kv_like((2, 2, 3, 64, 64), mx.float32)
    w, s, b = mx.quantize(x, group_size=64, bits=8)
    y = mx.dequantize(w, s, b, group_size=64, bits=8)
    w, s, b = mx.quantize(y, group_size=64, bits=8)
    assert not mx.array_equal(mx.dequantize(w, s, b, group_size=64, bits=8), y)


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 64), (4, 32)])
def test_layout_is_mlx_affine_and_error_is_bounded(bits, group):
    q = KVQuant(bits, group)
    x = kv_like((2, 2, 3, 16, 64), mx.float32, 3)
    w, s, b = q.quantize(x)
    assert w.dtype == mx.uint32 and w.shape == (2, 2, 3, 16, 64 * bits // 32)
    assert s.shape == b.shape == (2, 2, 3, 16, 64 // group) and s.dtype == mx.float32
    # quantized matmul reads the same values as dequantize
    a = mx.random.normal((5, 64), key=mx.random.key(0))
    flat = (w.reshape(-1, w.shape[-1]), s.reshape(-1, s.shape[-1]), b.reshape(-1, b.shape[-1]))
    got = mx.quantized_matmul(a, *flat, transpose=True, group_size=group, bits=bits)
    want = a @ q.dequantize(flat).T
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-3)
    # each value within one step of its group (steps are at most 2x the ideal (max-min)/levels)
    g = x.reshape(-1, group)
    step = (g.max(axis=-1) - g.min(axis=-1)) / q.levels
    err = mx.abs(q.round_trip(x).reshape(-1, group) - g).max(axis=-1)
    assert bool(mx.all(err <= step + 1e-6))


def test_sizes_and_ratios():
    """Bytes per position and head, against float32 and float16 pages (head_dim 64)."""
    assert KVQuant(8).row_bytes(64, mx.float32) == 64 + 8
    assert KVQuant(4).row_bytes(64, mx.float32) == 32 + 8
    assert KVQuant(8).row_bytes(64, mx.float32) / (64 * 4) <= 0.3
    assert KVQuant(4).row_bytes(64, mx.float32) / (64 * 4) <= 0.17
    assert KVQuant(8).row_bytes(64, mx.float16) / (64 * 2) <= 0.55


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32), (4, 128)])
def test_a_page_is_one_array_cut_and_joined_along_positions(bits, group, dtype):
    q = KVQuant(bits, group)
    x = kv_like((2, 2, 3, 10, 128), dtype, 4)
    page = q.encode(x)
    assert page.dtype == mx.uint32 and page.shape == (2, 2, 3, 10, q.words(128, dtype))
    assert page.nbytes == q.page_bytes(2, 3, 128, 10, dtype)
    assert same_bits(q.decode(page, dtype), q.round_trip(x))
    a, b = page[:, :, :, :4, :], page[:, :, :, 4:, :]
    assert same_bits(q.decode(mx.concatenate([a, b], axis=3), dtype), q.round_trip(x))
    assert same_bits(q.decode(b, dtype), q.round_trip(x)[:, :, :, 4:, :])


def test_settings_and_description():
    assert make_quant(None) is None and make_quant(0) is None
    assert make_quant(8) == KVQuant(8, 64)
    assert KVQuant(8).describe() != KVQuant(4).describe() != KVQuant(4, 32).describe()
    with pytest.raises(ValueError):
        KVQuant(3)
    with pytest.raises(ValueError):
        KVQuant(8, 48)
    with pytest.raises(ValueError):
        KVQuant(8, 128).round_trip(mx.zeros((1, 1, 1, 64)))
