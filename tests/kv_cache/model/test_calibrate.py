"""Calibration of shaped keys (``kv_cache.model.calibrate``): the statistics are those of the
keys the model's own cache receives (post-RoPE, per KV head and channel) and of the queries its
attention reads them with, the same on a second run, and the keys turned to later positions are
those the model makes when it reads the text there."""

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.model.calibrate import CHUNK, key_stats
from kv_cache.model.spec_reader import spec_of_model
from tests.tiny_model import make_tiny_model


class Later:
    """A cache that reads its tokens from position ``start`` with nothing before them."""

    def __init__(self, start: int, got: list):
        self.offset, self.got, self.keys, self.values = start, got, None, None

    def update_and_fetch(self, keys, values):
        self.got.append(np.array(keys[0]))
        self.keys = keys if self.keys is None else mx.concatenate([self.keys, keys], axis=2)
        self.values = values if self.values is None else mx.concatenate([self.values, values],
                                                                         axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values

    def make_mask(self, n, **kwargs):
        return "causal" if n > 1 else None


def reference(model, tokens, starts=(0,)) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Every layer's keys over ``tokens`` read in the same chunks from each of ``starts``:
    mean and std."""
    got: dict[int, list] = {i: [] for i in range(len(model.layers))}
    for start in starts:
        caches = [Later(start, got[i]) for i in range(len(model.layers))]
        for a in range(0, len(tokens), CHUNK):
            model(mx.array([tokens[a : a + CHUNK]]), cache=caches)
    out = {}
    for i, parts in got.items():
        k = np.concatenate(parts, axis=1)  # [heads, T, D]
        out[i] = (k.mean(axis=1), k.std(axis=1))
    return out


def test_the_statistics_are_those_of_the_keys_and_queries():
    model = make_tiny_model(seed=5, num_layers=3, hidden=128, heads=4, kv_heads=2)
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 300, size=CHUNK + 40)]
    spec = spec_of_model(model)
    from mlx_lm.models import llama

    before = llama.scaled_dot_product_attention
    st = key_stats(model, tokens, spec, positions=len(tokens))  # where it was read
    assert llama.scaled_dot_product_attention is before  # the watch is taken off after
    ref = reference(model, tokens)
    assert sorted(st) == [0, 1, 2]
    for i, (mean, std) in ref.items():
        assert st[i].mean.shape == (2, 32)
        np.testing.assert_allclose(st[i].mean, mean, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(st[i].std, std, rtol=1e-3, atol=1e-5)
        # the queries were seen (through the attention hook): not the ones used without them
        assert not np.allclose(st[i].query_rms, 1.0) and (st[i].query_rms > 0).all()
    again = key_stats(model, tokens, spec, positions=len(tokens))
    assert all(np.array_equal(again[i].mean, st[i].mean) for i in st)


def test_keys_turned_to_later_positions_are_those_read_there():
    """Read from positions 0, 100, 200 and 300 (each with nothing before it, as RoPE makes
    alike), the model's keys have the statistics ``key_stats`` computes from one reading."""
    model = make_tiny_model(seed=6, num_layers=2, hidden=128, heads=4, kv_heads=2)
    tokens = [int(t) for t in np.random.default_rng(1).integers(3, 300, size=100)]
    st = key_stats(model, tokens, spec_of_model(model), positions=400)
    ref = reference(model, tokens, starts=(0, 100, 200, 300))
    near = key_stats(model, tokens, spec_of_model(model), positions=100)
    for i, (mean, std) in ref.items():
        np.testing.assert_allclose(st[i].mean, mean, rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(st[i].std, std, rtol=1e-3, atol=1e-4)
        assert not np.allclose(near[i].mean, mean, rtol=1e-3, atol=1e-4)  # the turn matters


def test_no_tokens_is_an_error():
    model = make_tiny_model(seed=5)
    with pytest.raises(ValueError, match="tokens"):
        key_stats(model, [], spec_of_model(model))
