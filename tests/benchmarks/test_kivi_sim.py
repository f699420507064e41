"""benchmarks/kivi_sim.py: the KIVI-style key simulation of benchmarks/kv_quality.py (per-channel
scales over blocks of positions, the trailing block float, each block coded once whatever the
chunking, and each query reading what a token-by-token decode would)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention

from kv_cache.layout.quant import KVQuant
from benchmarks.kivi_sim import KiviCache, kivi_round_trip

H, D = 3, 64


def _keys(n: int, seed: int = 0) -> mx.array:
    """Keys ``[1, H, n, D]`` like the default model's: each channel far off centre (offsets up
    to ~14) with its own spread (0.01 to 3)."""
    rng = np.random.default_rng(seed)
    off = rng.normal(0, 6, size=(1, H, 1, D))
    spread = np.exp(rng.uniform(math.log(0.01), math.log(3.0), size=(1, H, 1, D)))
    return mx.array((off + spread * rng.normal(size=(1, H, n, D))).astype(np.float32))


def test_scales_are_per_channel_over_each_block_and_bound_the_error():
    x = _keys(96)
    read, scale, bias = kivi_round_trip(x, 32, 4)
    assert scale.shape == bias.shape == (1, H, 3, 1, D)
    y = np.array(x).reshape(1, H, 3, 32, D)
    lo, hi = y.min(axis=3, keepdims=True), y.max(axis=3, keepdims=True)
    s, b = np.array(scale), np.array(bias)
    # one scale and bias per (head, block, channel): the channel's own range over the block
    assert np.all(b <= lo) and np.all(lo - b <= np.abs(lo) * 2.0 ** -10 + 2.0 ** -24)
    want = (hi - b) / 15
    assert np.all(s >= want) and np.all(s <= want * (1 + 2.0 ** -10) + 2.0 ** -24)
    assert np.array_equal(s.astype(np.float16).astype(np.float32), s)  # float16 values
    ratio = s.max(axis=-1) / s.min(axis=-1)  # channels' spreads differ by up to ~300x
    assert ratio.min() > 10
    # every key within half a step of its decoded value, the step its own channel's
    err = np.abs(np.array(read).reshape(y.shape) - y)
    assert np.all(err <= s / 2 + np.abs(y) * 2.0 ** -23)
    codes = (np.array(read).reshape(y.shape) - b) / s
    assert np.allclose(codes, np.round(codes), atol=1e-3) and codes.min() > -1e-3 \
        and codes.max() < 15 + 1e-3
    with pytest.raises(ValueError):
        kivi_round_trip(x[..., :40, :], 32)


CHUNKINGS = [[80], [1] * 80, [5, 27, 1, 40, 7], [32, 32, 16], [31, 2, 47]]


def _feed(cache: KiviCache, x: mx.array, v: mx.array, sizes: list[int]):
    """Each piece's (keys passed on, values passed on, mask, queries' positions)."""
    out, a = [], 0
    for n in sizes:
        mask = cache.make_mask(n)
        k, vv = cache.update_and_fetch(x[..., a:a + n, :], v[..., a:a + n, :])
        out.append((k, vv, mask, a))
        a += n
    return out


@pytest.mark.parametrize("sizes", CHUNKINGS)
def test_blocks_coded_once_whatever_the_chunking_and_the_open_block_float(sizes):
    x, v = _keys(80), _keys(80, seed=1)
    whole, _, _ = kivi_round_trip(x[..., :64, :], 32)
    cache = KiviCache(32, 4, None)
    _feed(cache, x, v, sizes)
    # the sealed blocks: exactly the round trip of each complete block, bit for bit
    assert cache.n_sealed == 64
    assert np.array_equal(np.array(cache.sealed), np.array(whole))
    # the trailing incomplete block (64..79) is the float keys, bit for bit
    assert np.array_equal(np.array(cache.keys[..., 64:80, :]), np.array(x[..., 64:80, :]))
    # what each piece passes on: decoded keys before its first query's block, float after
    cache = KiviCache(32, 4, None)
    for k, vv, mask, a in _feed(cache, x, v, sizes):
        n = mask.shape[0]
        lo, q = a // 32 * 32, (a + n - 1) // 32 * 32
        assert k.shape[2] == q + (a + n - lo) == mask.shape[1]
        assert np.array_equal(np.array(k[..., :q, :]), np.array(whole[..., :q, :]))
        assert np.array_equal(np.array(k[..., q:, :]), np.array(x[..., lo:a + n, :]))
        assert np.array_equal(np.array(vv[..., q:, :]), np.array(v[..., lo:a + n, :]))


@pytest.mark.parametrize("sizes", CHUNKINGS)
def test_each_query_reads_earlier_blocks_decoded_and_its_own_block_float(sizes):
    """Attention through the cache as an mlx-lm model runs it (the mask from
    ``create_attention_mask``, keys and values from ``update_and_fetch``, mlx-lm's
    ``scaled_dot_product_attention`` with the cache) equals a per-query reference: query ``t`` reads
    the decoded keys of positions before its block's start and the float keys from there to
    ``t``; values as the page codec gives them. Whatever the chunking."""
    n_all, heads = 80, 9
    x, v = _keys(n_all), _keys(n_all, seed=1)
    q = mx.array(np.random.default_rng(2).normal(size=(1, heads, n_all, D)).astype(np.float32))
    codec = KVQuant(4)
    dec = np.array(kivi_round_trip(x[..., :64, :], 32)[0])[0]
    xf, vq = np.array(x)[0], np.array(codec.round_trip(v))[0]
    qn = np.array(q)[0]
    ref = np.zeros((heads, n_all, D), np.float32)
    for t in range(n_all):
        s = t // 32 * 32
        keys = np.concatenate([dec[:, :s], xf[:, s:t + 1]], axis=1)
        for h in range(heads):
            sc = keys[h // 3] @ qn[h, t] / 8.0
            p = np.exp(sc - sc.max())
            ref[h, t] = (p / p.sum()) @ vq[h // 3, :t + 1]
    cache = KiviCache(32, 4, codec)
    got, a = [], 0
    for n in sizes:
        mask = create_attention_mask(mx.zeros((1, n, 8)), cache)
        k, vv = cache.update_and_fetch(x[..., a:a + n, :], v[..., a:a + n, :])
        o = scaled_dot_product_attention(q[..., a:a + n, :], k, vv, cache=cache, scale=1 / 8.0,
                                         mask=mask)
        got.append(np.array(o)[0])
        a += n
    np.testing.assert_allclose(np.concatenate(got, axis=1), ref, rtol=1e-4, atol=1e-4)


def test_the_control_codes_sealed_keys_per_position_and_keeps_the_open_block_float():
    x, v = _keys(80), _keys(80, seed=1)
    cache = KiviCache(32, 4, None, per_channel=False)
    _feed(cache, x, v, [5, 27, 1, 40, 7])
    assert np.array_equal(np.array(cache.sealed), np.array(KVQuant(4).round_trip(x[..., :64, :])))
    assert np.array_equal(np.array(cache.keys[..., 64:80, :]), np.array(x[..., 64:80, :]))
