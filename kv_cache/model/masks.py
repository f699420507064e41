"""The mask of a group's own keys in the split attention path (``kv_cache.model.attention``)
and the row index of a ragged pass."""

from __future__ import annotations

from itertools import accumulate

import mlx.core as mx

from kv_cache.model.reads import Reads

_FAR = 1 << 30


def build_mask(reads: list[Reads], lens: list[int], T: int, N: int) -> mx.array | None:
    """Additive mask ``[B, 1, 1, T, N]`` over the padded own keys of ``reads`` (``lens`` of
    them each), or None when every key is visible to every query: causal, within a window, and
    with keys per channel over pages (``Reads.block``) a key of the query's own page read as
    float, a key of an earlier page as its decoded copy."""
    if T == 1 and all(n == N for n in lens) and all(
            not r.window or r.q_start - r.own_start < r.window for r in reads):
        return None
    j = mx.arange(N)[None]
    plain = mx.array([n - r.copies for n, r in zip(lens, reads)])[:, None]
    own = mx.array([r.own_start for r in reads])[:, None]
    frm = mx.array([r.float_from if r.block else 0 for r in reads])[:, None]
    kpos = mx.where(j < plain, own + j, frm + j - plain)  # [B, N]
    valid = j < mx.array(lens)[:, None]
    qpos = mx.array([r.q_start for r in reads])[:, None] + mx.arange(T)[None]  # [B, T]
    visible = (kpos[:, None, :] <= qpos[:, :, None]) & valid[:, None, :]
    windows = mx.array([r.window or _FAR for r in reads])[:, None, None]
    visible = visible & (kpos[:, None, :] > qpos[:, :, None] - windows)
    if any(r.block for r in reads):
        block = mx.array([r.block or _FAR for r in reads])[:, None, None]
        is_float = (j < plain) & (kpos >= frm)
        same = (kpos[:, None, :] // block) == (qpos[:, :, None] // block)
        visible = visible & (is_float[:, None, :] == same)
    return mx.where(visible, 0.0, -mx.inf)[:, None, None].astype(mx.float32)


def ragged_index(lengths: list[int]) -> tuple[mx.array, mx.array]:
    """For a ragged pass (``lengths[i]`` rows of sequence ``i`` one after the other): where each
    sequence's ``max(lengths)`` queries come from among the rows (its last row again past its
    own), and where each row's output lies among theirs."""
    T = max(lengths)
    starts = accumulate(lengths, initial=0)
    return (mx.array([a + min(j, n - 1) for a, n in zip(starts, lengths) for j in range(T)]),
            mx.array([i * T + j for i, n in enumerate(lengths) for j in range(n)]))
