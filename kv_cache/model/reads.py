"""What one sequence's queries read at one layer (``Reads``): made by the layer caches
(``layer_cache``, ``channel_cache``, ``batch``), read by attention (``attention``) and its
masks (``masks``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass(slots=True)
class Reads:
    """What one sequence's queries read at one layer: an optional shared prefix, its own keys and
    values ``[1, kv_heads, n, head_dim]`` starting at position ``own_start``, its first query's
    position, the layer's window (0: full), and any runs of positions that attend both ways."""

    prefix: tuple[mx.array, mx.array] | None
    view: Any
    keys: mx.array
    values: mx.array
    own_start: int
    q_start: int
    window: int
    buffer: tuple[mx.array, mx.array] | None = None  # the buffers ``keys`` is a slice of,
    at: int = 0  # from this index (padding can then be a longer slice, not a copy)
    # keys per channel over pages of ``block`` (``kv_cache.model.channel_cache``): ``keys``
    # float from ``float_from``, then ``copies`` decoded copies of the positions from it
    block: int = 0
    float_from: int = 0
    copies: int = 0
    # runs of positions ``(start, end)`` whose queries and keys see each other both ways (an
    # image of a model that reads it so, ``masks.Bidirectional``); causal everywhere else
    blocks: tuple[tuple[int, int], ...] = ()

    def padded(self, n: int) -> tuple[mx.array, mx.array]:
        """Own keys and values stretched to ``n`` positions (the extra ones are masked)."""
        k, v = self.keys, self.values
        if k.shape[2] == n:
            return k, v
        if self.buffer is not None and self.buffer[0].shape[2] >= self.at + n:
            bk, bv = self.buffer
            return bk[..., self.at : self.at + n, :], bv[..., self.at : self.at + n, :]
        return pad(k, n), pad(v, n)


def pad(a: mx.array, n: int, axis: int = 2) -> mx.array:
    """``a`` stretched to ``n`` along ``axis`` with zeros (positions the mask hides)."""
    if a.shape[axis] == n:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, n - a.shape[axis])
    return mx.pad(a, widths)
