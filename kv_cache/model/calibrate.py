"""Calibrating shaped keys (``kv_cache.layout.key_shape``): one forward pass over a fixed text.

``key_stats(model, tokens, spec)`` runs the model over ``tokens`` with mlx-lm's own caches
(nothing paged, nothing kept) and measures, for every paged layer of ``spec``, its keys' mean
and standard deviation per KV head and channel (post-RoPE, as pages hold them) and the root mean
square of the queries that read them (seen by wrapping, for the pass, the attention function
the model's modules call; ones for a model whose modules call none by that name). The caller picks the text and keeps it fixed:
the statistics enter the cache's fingerprint (``with_kv_bits``).

Positions: pages hold keys after RoPE, so a channel pair's mean turns with the position, and a
text of 512 tokens sees only its first 512 (measured: an offset calibrated on 512 positions
costs the default model +3.7% at 4 bits on positions 512-1,023, one on 1,024 positions +2.7%).
RoPE depends on relative positions only, so the same text read from position ``P`` gives the
same keys turned by ``P``: the statistics are taken over the keys (and queries) turned by the
layer's own ``rope`` to every multiple of the text's length below ``positions`` (8,192 by
default), as if the text had been read at each of them; a layer without a ``rope`` module is
measured where it was read.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from kv_cache.layout.key_shape import KeyStats
from kv_cache.layout.spec import CacheSpec

CHUNK = 256  # tokens a forward pass


class _Sums:
    """Running sums of one layer's keys and queries, per KV head and channel (float32), over
    every shift of their positions."""

    def __init__(self, rope, shifts: Sequence[int]):
        self.rope, self.shifts = rope, list(shifts) if rope is not None else [0]
        self.n = self.nq = 0
        self.k = self.k2 = self.q2 = None

    def _turned(self, x: mx.array):
        """``x [B, heads, T, D]`` (after RoPE) as if read ``shift`` positions later."""
        x = x.astype(mx.float32)
        B, H, T, D = x.shape
        for shift in self.shifts:
            yield x if not shift else self.rope(x.reshape(B, H * T, 1, D),
                                                offset=shift).reshape(B, H, T, D)

    def keys(self, k: mx.array) -> None:  # [B, kv_heads, T, head_dim]
        for x in self._turned(k):
            s, s2 = x.sum(axis=(0, 2)), (x * x).sum(axis=(0, 2))
            self.k = s if self.k is None else self.k + s
            self.k2 = s2 if self.k2 is None else self.k2 + s2
            self.n += x.shape[0] * x.shape[2]

    def queries(self, q: mx.array, kv_heads: int) -> None:  # [B, heads, T, head_dim]
        for x in self._turned(q):
            B, H, T, D = x.shape
            s2 = (x.reshape(B, kv_heads, H // kv_heads, T, D) ** 2).sum(axis=(0, 2, 3))
            self.q2 = s2 if self.q2 is None else self.q2 + s2
            self.nq += B * (H // kv_heads) * T

    def stats(self) -> KeyStats:
        mean = np.array(self.k / self.n)
        var = np.maximum(np.array(self.k2 / self.n) - mean * mean, 0.0)
        q = np.sqrt(np.array(self.q2 / self.nq)) if self.nq else np.ones_like(mean)
        return KeyStats(mean, np.sqrt(var), q)


def _watch(cache, sums: _Sums) -> None:
    """Make ``cache`` (one of mlx-lm's) report its layer's keys and queries to ``sums``."""
    base = type(cache)

    class Watched(base):  # type: ignore[misc, valid-type]
        def update_and_fetch(self, keys, values):
            sums.keys(keys)
            return base.update_and_fetch(self, keys, values)

        def watch_queries(self, queries, keys):
            sums.queries(queries, keys.shape[1])

    cache.__class__ = Watched


@contextmanager
def _queries_watched(model) -> Iterator[None]:
    """For the block, every module of ``model`` that calls ``scaled_dot_product_attention``
    (mlx-lm's, or ``kv_cache.model.attention``'s once installed) shows a watched cache its
    queries first; the functions are put back after."""
    mods = {sys.modules.get(type(m).__module__) for _, m in model.named_modules()}
    saved = {mod: mod.scaled_dot_product_attention for mod in mods
             if callable(getattr(mod, "scaled_dot_product_attention", None))}

    def watching(fn):
        def sdpa(queries, keys, values, *args, cache=None, **kwargs):
            watch = getattr(cache, "watch_queries", None)
            if watch is not None:
                watch(queries, keys)
            return fn(queries, keys, values, *args, cache=cache, **kwargs)
        return sdpa

    for mod, fn in saved.items():
        mod.scaled_dot_product_attention = watching(fn)
    try:
        yield
    finally:
        for mod, fn in saved.items():
            mod.scaled_dot_product_attention = fn


def _rope(model, slot: int):
    """The ``rope`` module of the layer behind cache slot ``slot`` (None: not found)."""
    layers = getattr(model, "layers", None)
    if layers is None or slot >= len(layers):
        return None
    for name, m in layers[slot].named_modules():
        if name.split(".")[-1] == "rope" and callable(m):
            return m
    return None


def key_stats(model, tokens: Sequence[int], spec: CacheSpec,
              positions: int = 8192) -> dict[int, KeyStats]:
    """The keys (and queries) of ``model``'s paged layers over ``tokens`` read at every
    multiple of ``len(tokens)`` below ``positions``, per model slot."""
    if not tokens:
        raise ValueError("calibration needs tokens")
    caches = make_prompt_cache(model)
    shifts = range(0, max(positions, len(tokens)), len(tokens))
    sums = {s: _Sums(_rope(model, s), shifts) for g in spec.groups for s in g.layers}
    for slot, s in sums.items():
        _watch(caches[slot], s)
    with _queries_watched(model):
        for a in range(0, len(tokens), CHUNK):
            model(mx.array([list(tokens[a : a + CHUNK])]), cache=caches)
            mx.eval([v for s in sums.values() for v in (s.k, s.k2, s.q2) if v is not None])
    return {slot: s.stats() for slot, s in sums.items() if s.n}
