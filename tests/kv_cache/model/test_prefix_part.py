"""A prefix's part of split attention (kv_cache/model/prefix_part.py): scores and weighted values
in each form give the softmax's pieces over the prefix, and parts merge row by row."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kv_cache.model import cpu_forms, prefix_part


@pytest.mark.parametrize("keys_first", [True, False])
def test_a_part_is_the_softmax_pieces_over_its_keys(keys_first, monkeypatch):
    """Kept keys first (x86's CPU form) or plain, a part's maxima, weighted values and sums are
    those of ``exp(q k^T - m) v`` over the prefix, with any ``m`` at least the rows' maxima."""
    monkeypatch.setattr(cpu_forms, "PRODUCTS", keys_first)
    mx.random.seed(2)
    Hkv, rows, n, D = 2, 3, 300, 16
    q = mx.random.normal((Hkv, rows, D)) * 0.3
    k, v = mx.random.normal((Hkv, n, D)), mx.random.normal((Hkv, n, D))
    part = prefix_part.scores(q, (k, v))
    assert part.flip == cpu_forms.keys_first(q, k)
    s = q @ k.swapaxes(-1, -2)
    assert mx.allclose(part.maxima, s.max(axis=-1, keepdims=True), atol=1e-5).item()
    m = part.maxima + 0.5  # another part's higher maximum
    out, denom = prefix_part.weighted(part, m)
    e = mx.exp(s - m)
    assert mx.allclose(denom, e.sum(axis=-1, keepdims=True), rtol=1e-5).item()
    assert mx.allclose(out, e @ v, rtol=1e-4, atol=1e-5).item()


def test_by_rows_merges_only_the_rows_given():
    a = mx.arange(12, dtype=mx.float32).reshape(3, 1, 4)
    r = mx.full((1, 1, 4), 5.0)
    got = prefix_part.by_rows(mx.maximum, a, [r, None, r])
    assert got.tolist() == [[[5, 5, 5, 5]], [[4, 5, 6, 7]], [[8, 9, 10, 11]]]
    assert prefix_part.by_rows(mx.add, a, [r, r, r]).tolist() == (a + 5).tolist()
