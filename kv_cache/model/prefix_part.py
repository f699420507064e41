"""A prefix's part of split attention (``attention._group``): the scores of some query rows over
keys that come before all of them (a view shared by a group of sequences), and later their
weighted sum of values; attention merges it with its own keys' part by their shared row maxima
(the log-sum-exp)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(slots=True)
class Part:
    """Scores of ``rows`` query rows over a prefix ``[kv_heads, rows, keys]`` and each row's
    maximum ``[kv_heads, rows, 1]``."""

    prefix: tuple[mx.array, mx.array]
    scores: mx.array
    maxima: mx.array


def prefix_length(prefix: tuple[mx.array, mx.array]) -> int:
    """Positions of a prefix ``(K, V)``."""
    return prefix[0].shape[1]


def scores(q: mx.array, prefix: tuple[mx.array, mx.array]) -> Part:
    """``q [kv_heads, rows, head_dim]`` (scaled) over ``prefix``'s keys ``[kv_heads, n, dim]``."""
    s = (q @ prefix[0].swapaxes(-1, -2)).astype(mx.float32)
    return Part(prefix, s, s.max(axis=-1, keepdims=True))


def weighted(part: Part, m: mx.array) -> tuple[mx.array, mx.array]:
    """With the rows' maxima over every part ``m [kv_heads, rows, 1]``: (the weighted sum of the
    prefix's values ``[kv_heads, rows, dim]``, the weights' sum ``[kv_heads, rows, 1]``)."""
    values = part.prefix[1]
    e = mx.exp(part.scores - m)
    return e.astype(values.dtype) @ values, e.sum(axis=-1, keepdims=True)
