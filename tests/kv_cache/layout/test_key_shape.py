"""Shaped keys (``kv_cache.layout.key_shape``): offsets and channel weights from calibration, a
page still decodes bit for bit to what the model read, the weights keep 3 significant bits and
the offsets are float16 values, the shape lowers the error of keys that sit off centre, and its
digest follows its values (the fingerprint's part)."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.layout.key_shape import KeyShape, KeyStats, shapes_for
from kv_cache.layout.quant import KVQuant
from tests.kv_cache.layout.test_quant import DTYPES, kv_like, same_bits

SETTINGS = [KVQuant(4), KVQuant(8), KVQuant(8, 64, 4), KVQuant(4, 32), KVQuant(8, 128),
            KVQuant(4, 32, rotate=False), KVQuant(8, 64, 4, rotate=False)]


def stats(layers=3, heads=2, dim=128, seed=0) -> dict[int, KeyStats]:
    """Keys off centre by up to 12 with spreads over a decade, queries of mixed size."""
    rng = np.random.default_rng(seed)
    return {s: KeyStats(rng.normal(size=(heads, dim)) * 6,
                        np.exp(rng.normal(size=(heads, dim))),
                        np.exp(rng.normal(size=(heads, dim)) * 0.5))
            for s in range(layers)}


def shaped(q: KVQuant, layers=3, heads=2, dim=128, seed=0) -> KVQuant:
    return replace(q, keys=KeyShape.from_stats(range(layers), stats(layers, heads, dim, seed)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q", SETTINGS, ids=[q.label() for q in SETTINGS])
def test_a_shaped_page_decodes_to_what_the_model_read(q, dtype):
    """The whole group coded at once (``encode``), one layer coded alone by its slot
    (``fresh(..., slot)``), any run of positions decoded: the same bits."""
    q = shaped(q)
    k, v = kv_like((3, 2, 20, 128), dtype, 1), kv_like((3, 2, 20, 128), dtype, 2)
    rk, rv, kw, vw = q.fresh(k, v)
    page = q.join(kw, vw)
    both = q.decode(page, dtype, 128)
    assert same_bits(both[:, 0], rk) and same_bits(both[:, 1], rv)
    assert same_bits(q.decode(page[..., 3:9, :], dtype, 128), both[..., 3:9, :])
    assert same_bits(q.encode(mx.stack([k, v], axis=1)), page)
    for slot in range(3):
        alone = q.fresh(k[slot][None, :, 5:7], v[slot][None, :, 5:7], slot)
        assert same_bits(alone[0][0], rk[slot, :, 5:7]) and same_bits(alone[1][0], rv[slot, :, 5:7])
        assert same_bits(alone[2][0], kw[slot, :, 5:7])
    # the values are not shaped: coded as without a shape
    assert same_bits(rv, replace(q, keys=None).fresh(k, v)[1])


def test_weights_keep_three_bits_and_offsets_are_float16():
    s = KeyShape.from_stats(range(3), stats())
    w, o = np.array(s.scales), np.array(s.offsets)
    assert w.shape == o.shape == (3, 2, 1, 128) and (w > 0).all() and (w <= 1).all()
    mant = w / 2.0 ** np.floor(np.log2(w))
    assert np.array_equal(mant * 4, np.round(mant * 4))  # 1, 1.25, 1.5 or 1.75 (or 2)
    assert np.array_equal(o, o.astype(np.float16).astype(np.float32))
    assert np.abs(o).max() > 5  # the offsets are the keys' means, not zeros


def test_the_shape_lowers_the_error_of_keys_off_centre():
    """Keys whose channels sit off centre (as real models' do: means of 10 against spreads of
    1): the 4-bit error, weighted by what the queries see, is several times lower shaped."""
    rng = np.random.default_rng(3)
    mean = rng.normal(size=(2, 64)) * 8
    std = np.exp(rng.normal(size=(2, 64)) * 0.5)
    qrms = np.exp(rng.normal(size=(2, 64)) * 0.5)
    x = mean[None, :, None, :] + rng.normal(size=(1, 2, 512, 64)) * std[None, :, None, :]
    x = mx.array(x.astype(np.float32))
    q = KVQuant(4, 64)
    s = replace(q, keys=KeyShape.from_stats([0], {0: KeyStats(mean, std, qrms)}))
    weight = mx.array(qrms[None, :, None, :].astype(np.float32))
    err = {name: mx.sqrt((((c.round_trip(x, 0) - x) * weight) ** 2).mean()).item()
           for name, c in (("plain", q), ("shaped", s))}
    assert err["shaped"] < err["plain"] / 2


def test_the_digest_follows_the_values_and_bad_statistics_are_tamed():
    a, b = KeyShape.from_stats(range(3), stats()), KeyShape.from_stats(range(3), stats())
    c = KeyShape.from_stats(range(3), stats(seed=1))
    assert a == b and hash(a) == hash(b) and a != c
    assert KVQuant(4, keys=a) == KVQuant(4, keys=b) != KVQuant(4, keys=c)
    assert a.describe()["kv_key_shape"].endswith(a.digest)
    bad = {0: KeyStats(np.full((1, 64), np.nan), np.zeros((1, 64)), np.zeros((1, 64)))}
    s = KeyShape.from_stats([0], bad)
    assert np.isfinite(np.array(s.scales)).all() and np.isfinite(np.array(s.offsets)).all()
    assert (np.array(s.scales) > 0).all()
    x = mx.array(np.random.default_rng(0).normal(size=(1, 1, 4, 64)).astype(np.float32))
    assert mx.all(mx.isfinite(KVQuant(4, keys=s).round_trip(x, 0))).item()


def test_shapes_for_groups_of_slots():
    st = stats(layers=4)
    shapes = shapes_for([(0, 2), (1, 3), (5,)], st)
    assert shapes[0].slots == (0, 2) and shapes[1].slots == (1, 3) and shapes[2] is None
    o, w = shapes[1].layer(3)
    assert mx.array_equal(o, shapes[1].offsets[1]).item() and w.shape == (2, 1, 128)
    assert shapes_for([(0,)], None) == [None]
