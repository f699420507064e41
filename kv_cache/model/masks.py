"""The mask of a group's own keys in the split attention path (``kv_cache.model.attention``),
the row index of a ragged pass, and ``Bidirectional``: a prompt piece's runs of tokens that
attend to each other both ways."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import mlx.core as mx

from kv_cache.model.reads import Reads

_FAR = 1 << 30


@dataclass(frozen=True, slots=True)
class Bidirectional:
    """The ``mask`` a model passes to its attention for a prompt piece in which each run
    ``(start, end)`` of ``blocks`` (counted from the piece's first token) attends both ways:
    a query of a run sees every key of its run, later ones included, and everything else is as
    the layer's own mask (causal, within its window). Hugging Face's Gemma 3 reads an image's
    tokens so. Each layer's attention (``kv_cache.model.attention``) makes it its own mask from
    what the layer reads, so one object serves full and sliding-window layers alike; the piece
    holds each run whole (its keys are the piece's own)."""

    blocks: tuple[tuple[int, int], ...]


def build_mask(reads: list[Reads], lens: list[int], T: int, N: int) -> mx.array | None:
    """Additive mask ``[B, 1, 1, T, N]`` over the padded own keys of ``reads`` (``lens`` of
    them each), or None when every key is visible to every query: causal, within a window, and
    with keys per channel over pages (``Reads.block``) a key of the query's own page read as
    float, a key of an earlier page as its decoded copy. A query inside one of a row's
    ``Reads.blocks`` also sees every key of that run (whatever the window; a later key of it as
    float)."""
    if T == 1 and all(n == N for n in lens) and all(
            not r.window or r.q_start - r.own_start < r.window for r in reads) \
            and not any(r.blocks for r in reads):
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
    if any(r.blocks for r in reads):
        visible = visible | (_both_ways(reads, qpos, kpos) & valid[:, None, :])
    if any(r.block for r in reads):
        block = mx.array([r.block or _FAR for r in reads])[:, None, None]
        is_float = (j < plain) & (kpos >= frm)
        qpage, kpage = qpos[:, :, None] // block, kpos[:, None, :] // block
        visible = visible & ((is_float[:, None, :] == (kpage == qpage))
                             | (is_float[:, None, :] & (kpage > qpage)))
    return mx.where(visible, 0.0, -mx.inf)[:, None, None].astype(mx.float32)


def _both_ways(reads: list[Reads], qpos: mx.array, kpos: mx.array) -> mx.array:
    """``[B, T, N]``: where a query and a key lie in the same run of their row's blocks."""
    rows = []
    for i, r in enumerate(reads):
        same = mx.zeros((qpos.shape[1], kpos.shape[1]), dtype=mx.bool_)
        for a, b in r.blocks:
            q_in = (qpos[i] >= a) & (qpos[i] < b)
            k_in = (kpos[i] >= a) & (kpos[i] < b)
            same = same | (q_in[:, None] & k_in[None, :])
        rows.append(same)
    return mx.stack(rows)


def ragged_index(lengths: list[int]) -> tuple[mx.array, mx.array]:
    """For a ragged pass (``lengths[i]`` rows of sequence ``i`` one after the other): where each
    sequence's ``max(lengths)`` queries come from among the rows (its last row again past its
    own), and where each row's output lies among theirs."""
    T = max(lengths)
    starts = accumulate(lengths, initial=0)
    return (mx.array([a + min(j, n - 1) for a, n in zip(starts, lengths) for j in range(T)]),
            mx.array([i * T + j for i, n in enumerate(lengths) for j in range(n)]))
