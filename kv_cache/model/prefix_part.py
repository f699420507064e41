"""A prefix's part of split attention (``attention._group``): the scores of some query rows over
keys that come before all of them, and later their weighted sum of values, in whichever form
pays: kept keys first on x86's CPU (``cpu_forms``), or plain products. A prefix here is a view
shared by a group of sequences, or one sequence's own keys before its first query
(``Reads.mine``); attention merges any number of such parts with its own keys' part by their
shared row maxima (the log-sum-exp)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from kv_cache.model.cpu_forms import exp, keys_first, keys_first_scores, keys_first_weighted


@dataclass(slots=True)
class Part:
    """Scores of ``rows`` query rows over a prefix (``[kv_heads, keys, rows]`` when kept keys
    first, else ``[kv_heads, rows, keys]``) and each row's maximum ``[kv_heads, rows, 1]``."""

    prefix: tuple[mx.array, mx.array]
    flip: bool
    scores: mx.array
    maxima: mx.array


def prefix_length(prefix: tuple[mx.array, mx.array]) -> int:
    """Positions of a prefix ``(K, V)``."""
    return prefix[0].shape[1]


def scores(q: mx.array, prefix: tuple[mx.array, mx.array]) -> Part:
    """``q [kv_heads, rows, head_dim]`` (scaled) over ``prefix``'s keys ``[kv_heads, n, dim]``."""
    if keys_first(q, prefix[0]):
        s, m = keys_first_scores(q, prefix[0])
        return Part(prefix, True, s, m)
    s = (q @ prefix[0].swapaxes(-1, -2)).astype(mx.float32)
    return Part(prefix, False, s, s.max(axis=-1, keepdims=True))


def weighted(part: Part, m: mx.array) -> tuple[mx.array, mx.array]:
    """With the rows' maxima over every part ``m [kv_heads, rows, 1]``: (the weighted sum of the
    prefix's values ``[kv_heads, rows, dim]``, the weights' sum ``[kv_heads, rows, 1]``)."""
    prefix = part.prefix
    if part.flip:
        return keys_first_weighted(part.scores, m, prefix[1])
    e = exp(part.scores - m)
    denom = e.sum(axis=-1, keepdims=True)
    return e.astype(prefix[1].dtype) @ prefix[1], denom


def by_rows(op, a: mx.array, rows: list[mx.array | None]) -> mx.array:
    """``a [B, ...]`` with row ``i`` replaced by ``op(a[i], rows[i])`` where ``rows[i]`` is
    given (``mx.maximum``: the row maxima over one more part; ``mx.add``: its sums added)."""
    if all(r is not None for r in rows):
        return op(a, mx.concatenate(rows) if len(rows) > 1 else rows[0])
    return mx.concatenate([a[i : i + 1] if r is None else op(a[i : i + 1], r)
                           for i, r in enumerate(rows)])
