"""A prefix's part of split attention (kv_cache/model/prefix_part.py): scores and weighted values
give the softmax's pieces over the prefix."""

from __future__ import annotations

import mlx.core as mx

from kv_cache.model import prefix_part


def test_a_part_is_the_softmax_pieces_over_its_keys():
    """A part's maxima, weighted values and sums are those of ``exp(q k^T - m) v`` over the
    prefix, with any ``m`` at least the rows' maxima."""
    mx.random.seed(2)
    Hkv, rows, n, D = 2, 3, 300, 16
    q = mx.random.normal((Hkv, rows, D)) * 0.3
    k, v = mx.random.normal((Hkv, n, D)), mx.random.normal((Hkv, n, D))
    part = prefix_part.scores(q, (k, v))
    s = q @ k.swapaxes(-1, -2)
    assert mx.allclose(part.maxima, s.max(axis=-1, keepdims=True), atol=1e-5).item()
    m = part.maxima + 0.5  # another part's higher maximum
    out, denom = prefix_part.weighted(part, m)
    e = mx.exp(s - m)
    assert mx.allclose(denom, e.sum(axis=-1, keepdims=True), rtol=1e-5).item()
    assert mx.allclose(out, e @ v, rtol=1e-4, atol=1e-5).item()
