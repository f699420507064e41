"""The page codec: MLX's affine layout, the stored integers and scales as the truth (what the
model reads of a fresh key is bit for bit what its page decodes to, whatever the shape, batch or
slice that decodes it), keys and values in their own bits, the rotation (orthogonal: queries
rotated the same way score the same), sizes, and the settings' description."""

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.layout.quant import KVQuant, make_quant, parse_bits, scale_dtype

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
SETTINGS = [KVQuant(8), KVQuant(4), KVQuant(8, 32, 4), KVQuant(4, 64, 8), KVQuant(4, 128),
            KVQuant(8, 128), KVQuant(4, 32, rotate=False), KVQuant(8, 64, 4, rotate=False)]
IDS = [q.label() for q in SETTINGS]


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
@pytest.mark.parametrize("q", SETTINGS, ids=IDS)
def test_what_the_model_reads_is_what_the_page_decodes_to(q, dtype):
    """``fresh``'s values are the decode of its own words, for the whole array, for one row of
    it coded alone, and for any run of positions cut out of the page (no shape, batch or kernel
    changes a bit)."""
    k, v = kv_like((3, 2, 20, 128), dtype, 1), kv_like((3, 2, 20, 128), dtype, 2)
    rk, rv, kw, vw = q.fresh(k, v)
    page = q.join(kw, vw)
    assert page.dtype == mx.uint32 and page.shape == (3, 2, 2, 20, q.words(128, dtype))
    both = q.decode(page, dtype, 128)
    assert same_bits(both[:, 0], rk) and same_bits(both[:, 1], rv)
    assert same_bits(q.decode(page[..., 7:11, :], dtype, 128), both[..., 7:11, :])
    alone = q.fresh(k[1:2, :, 5:6], v[1:2, :, 5:6])
    assert same_bits(alone[0], rk[1:2, :, 5:6]) and same_bits(alone[1], rv[1:2, :, 5:6])
    assert same_bits(alone[2], kw[1:2, :, 5:6]) and same_bits(alone[3], vw[1:2, :, 5:6])
    kw2, vw2 = q.split(page, 128, dtype)
    assert same_bits(kw2, kw) and same_bits(vw2, vw)
    assert same_bits(q.encode(mx.stack([k, v], axis=1)), page)


def test_coding_decoded_values_again_moves_some():
    """Why a commit writes the words ``fresh`` made instead of coding what the model read: the
    scales are not powers of two, so the round trip is not a projection."""
    x = kv_like((4, 3, 64, 64), mx.float32, 5)
    y = KVQuant(4, 32).round_trip(x)
    assert not same_bits(KVQuant(4, 32).round_trip(y), y)


@pytest.mark.parametrize("q", [KVQuant(8, 64), KVQuant(4, 64), KVQuant(4, 32),
                               KVQuant(8, 64, rotate=False), KVQuant(4, 32, rotate=False)],
                         ids=lambda q: q.label())
def test_layout_is_mlx_affine_and_error_is_bounded(q):
    """``mx.quantized_matmul`` reads the words as they are (rotated queries score as the model's
    queries do over the decoded keys), and each value is within one step of its group."""
    x = kv_like((2, 3, 16, 64), mx.float32, 3)
    x = x.at[0, 0, :6].multiply(0.0)  # NOTE: corner rows to the side: a clean bound below
    _, _, kw, _ = q.fresh(x, x)
    w, s, b = q.packed(kw, q.bits, mx.float32)
    assert w.dtype == mx.uint32 and w.shape == (2, 3, 16, 64 * q.bits // 32)
    assert s.shape == b.shape == (2, 3, 16, 64 // q.group_size)
    a = mx.random.normal((2, 3, 5, 64), key=mx.random.key(0))
    got = mx.quantized_matmul(q.rotate_queries(a), w, s, b, transpose=True,
                              group_size=q.group_size, bits=q.bits)
    want = a @ q.round_trip(x).swapaxes(-1, -2)
    assert mx.allclose(got, want, rtol=1e-3, atol=1e-2).item()
    # p @ V through the codes, rotated back, is p @ the decoded values
    p = mx.softmax(mx.random.normal((2, 3, 5, 16), key=mx.random.key(1)), axis=-1)
    got = q.unrotate(mx.quantized_matmul(p, w, s, b, transpose=False, group_size=q.group_size,
                                         bits=q.bits))
    assert mx.allclose(got, p @ q.round_trip(x), rtol=1e-3, atol=1e-2).item()
    # error: at most half a stored step, in the coded basis
    g = q.group_size
    y = q.rotate_queries(x) / g if q.rotate else x  # the coded basis (H is orthogonal up to g)
    got = q.rotate_queries(q.round_trip(x)) / g if q.rotate else q.round_trip(x)
    err = mx.abs(got - y).reshape(-1, g).max(axis=-1)
    bound = 0.5 * s.reshape(-1) * 1.001 + 1e-5 * (1 + mx.abs(y).reshape(-1, g).max(axis=-1))
    assert bool(mx.all(err <= bound))


def test_rotation_spreads_an_outlier_channel_and_lowers_the_error():
    """Keys with one large channel (as real models' keys have): the rotation cuts the 4-bit
    error several fold; without outliers it costs nothing much."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 4, 256, 64))
    x[..., 7] *= 30
    x = mx.array(x.astype(np.float32))
    err = {rot: mx.sqrt(((KVQuant(4, rotate=rot).round_trip(x) - x) ** 2).mean()).item()
           for rot in (True, False)}
    assert err[True] < err[False] / 3


def test_keys_and_values_in_their_own_bits():
    x = kv_like((1, 2, 8, 64), mx.float32, 7)
    k84, v84 = KVQuant(8, 64, 4).round_trip_pair(x, x)
    assert same_bits(k84, KVQuant(8).round_trip(x)) and same_bits(v84, KVQuant(4).round_trip(x))


def test_sizes_and_ratios():
    """Bytes per position and head (key and value), against float32 and float16 pages
    (head_dim 64): codes, then one float16 scale and bias a group."""
    assert KVQuant(8).kv_bytes(64, mx.float32) == 2 * (64 + 4)
    assert KVQuant(4).kv_bytes(64, mx.float32) == 2 * (32 + 4)
    assert KVQuant(8, 64, 4).kv_bytes(64, mx.float32) == 64 + 4 + 32 + 4
    assert KVQuant(4, 32).kv_bytes(64, mx.float32) == 2 * (32 + 8)
    full = 2 * 64 * 4
    assert KVQuant(8).kv_bytes(64, mx.float32) / full <= 0.27
    assert KVQuant(8, 64, 4).kv_bytes(64, mx.float32) / full <= 0.21
    assert KVQuant(4).kv_bytes(64, mx.float32) / full <= 0.15
    assert KVQuant(8).kv_bytes(64, mx.float16) / (full / 2) <= 0.54
    assert scale_dtype(mx.bfloat16) == mx.bfloat16 and scale_dtype(mx.float32) == mx.float16
    assert KVQuant(8, 64, 4).page_bytes(2, 3, 64, 10, mx.float32) == 2 * 3 * 10 * 104


def test_settings_parsing_and_description():
    assert make_quant(None) is None and make_quant(0) is None and make_quant("off") is None
    assert make_quant(8) == KVQuant(8, 64) == KVQuant(8, 64, 8, True)
    assert make_quant("8,4", 32) == KVQuant(8, 32, 4) and make_quant((4, 8)) == KVQuant(4, 64, 8)
    assert parse_bits("4") == (4, 4) and parse_bits(" 8,4 ") == (8, 4) and parse_bits(8) == (8, 8)
    for bad in ("3", "8,4,4", "8;4", "x", "16"):
        with pytest.raises(ValueError, match="--kv-bits"):
            parse_bits(bad)
    descriptions = {str(sorted(q.describe().items())) for q in SETTINGS}
    assert len(descriptions) == len(SETTINGS)
    for q in SETTINGS:
        assert KVQuant.from_description(q.describe()) == q
    with pytest.raises(ValueError):
        KVQuant(3)
    with pytest.raises(ValueError):
        KVQuant(8, 64, 2)
    with pytest.raises(ValueError):
        KVQuant(8, 48)
    with pytest.raises(ValueError):
        KVQuant(8, 128).round_trip(mx.zeros((1, 1, 1, 64)))
