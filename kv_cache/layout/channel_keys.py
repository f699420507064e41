"""Keys per channel over a page (the default of pages in bits): the key half of a page codec.

KIVI (Liu et al. 2024) quantizes keys **per channel along positions**: a key's channels differ
in range far more than its positions do (a few channels carry large offsets), so one scale and
bias per channel over a run of positions rounds them much finer than one per position along
``head_dim`` (this model's 4-bit keys +8.25% perplexity per position, +1.89% per channel over a
page with the open page read as float: an earlier run of benchmarks/kv_quality.py with
benchmarks/kivi_sim.py's settings, in docs/BENCHMARKS.md's git history).

Here the run is a page. A page's keys are coded once, when the page is full (``seal``), from
their float values: one float16 (bfloat16 for bfloat16 models) scale and bias per layer, head
and channel, the bias rounded down and the scale up so the page's range is covered (every key
within ``scale / 2`` of what it reads back). The row of a position holds its ``head_dim`` codes
(``head_dim * bits / 32`` words), then its share of the page's scales and biases
(``ceil(head_dim / page_size)`` words: channel ``c``'s pair is word ``c`` of the page's rows'
shares read in order), so a sealed page keeps the ``[layers, 2, kv_heads, n, words]`` shape of
every other page and moves through runs, disk files, the store and exports unchanged.

Exact as the position codec is: ``x = code * scale + bias`` (a 4 or 8-bit integer times a scale
of at most 11 significant bits: an exact product, one rounding in the sum), so what ``seal``
gives the model to read and what ``decode`` reads back from the words agree bit for bit, on any
backend and in any shape. Until its page is full a key is read as its float value
(``kv_cache.model.channel_cache``); a page that is not full has no codes yet (its rows' key
words are zeros, never read).
"""

from __future__ import annotations

import mlx.core as mx

from kv_cache.layout.rounding import MANTISSA, round_down, round_up


def scale_dtype(dtype: mx.Dtype) -> mx.Dtype:
    return mx.bfloat16 if dtype == mx.bfloat16 else mx.float16


def share_words(head_dim: int, block: int) -> int:
    """Words of a row that hold its share of its page's scales and biases."""
    return -(-head_dim // block)


def key_words(head_dim: int, bits: int, block: int) -> int:
    """``uint32`` words of one position's key of one head: codes, then the share."""
    return head_dim * bits // 32 + share_words(head_dim, block)


_COMPILED: dict = {}


def _codec(bits: int, block: int, dtype: mx.Dtype, head_dim: int) -> "_Channel":
    key = (bits, block, dtype, head_dim)
    c = _COMPILED.get(key)
    if c is None:
        c = _COMPILED[key] = _Channel(bits, block, dtype, head_dim)
    return c


def seal(keys: mx.array, bits: int, block: int) -> tuple[mx.array, mx.array]:
    """Float keys ``[..., n, head_dim]`` (``n`` a multiple of ``block``, page-aligned) coded per
    channel over each block: (what the model reads of them, in their dtype; their words
    ``[..., n, key_words]``)."""
    if keys.shape[-2] % block:
        raise ValueError(f"{keys.shape[-2]} positions are not whole pages of {block}")
    return _codec(bits, block, keys.dtype, keys.shape[-1]).seal(keys)


def quantize(y: mx.array, bits: int, sdt: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
    """Float32 keys ``[..., pages, block, head_dim]`` as codes (float32 integers), scales and
    biases ``[..., pages, 1, head_dim]`` (float32 holding ``sdt`` values): per channel over each
    page, the bias rounded down and the scale up, so ``codes * scale + bias`` is within
    ``scale / 2`` of every key."""
    levels = (1 << bits) - 1
    lo, hi = y.min(axis=-2, keepdims=True), y.max(axis=-2, keepdims=True)
    bias = round_down(lo, sdt)  # <= lo
    scale = round_up((hi - bias) * (1.0 / levels), MANTISSA[sdt], sdt)
    codes = mx.clip(mx.round((y - bias) / scale), 0, levels)  # bias + levels*scale >= hi
    return codes, scale, bias


def decode(words: mx.array, bits: int, block: int, dtype: mx.Dtype, head_dim: int) -> mx.array:
    """Key words ``[..., n, key_words]`` of page-aligned positions as the keys they hold, in
    ``dtype``: bit for bit what ``seal`` gave. Positions of a last page that is not full have
    no codes: they read as zeros."""
    n = words.shape[-2]
    whole = n // block * block
    c = _codec(bits, block, dtype, head_dim)
    lead = words.shape[:-2]
    parts = [c.decode(words[..., :whole, :])] if whole else []
    if whole < n:
        parts.append(mx.zeros((*lead, n - whole, head_dim), dtype))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)


class _Channel:
    """The compiled seal and decode of one bit width, page size, dtype and head_dim."""

    def __init__(self, bits: int, block: int, dtype: mx.Dtype, head_dim: int):
        self.bits, self.block, self.dtype, self.d = bits, block, dtype, head_dim
        self.sdt = scale_dtype(dtype)
        self.ncodes = head_dim * bits // 32
        self.share = share_words(head_dim, block)
        self.seal = mx.compile(self._seal)
        self.decode = mx.compile(self._decode)

    def _seal(self, keys: mx.array) -> tuple[mx.array, mx.array]:
        *lead, n, d = keys.shape
        P = self.block
        y = keys.astype(mx.float32).reshape(*lead, n // P, P, d)
        codes, scale, bias = quantize(y, self.bits, self.sdt)
        read = (codes * scale + bias).reshape(keys.shape).astype(keys.dtype)
        per = 32 // self.bits
        c = codes.astype(mx.uint32).reshape(*lead, n // P, P, self.ncodes, per)
        packed = (c << (mx.arange(per, dtype=mx.uint32) * self.bits)).sum(axis=-1)
        pairs = mx.stack([scale[..., 0, :], bias[..., 0, :]], axis=-1).astype(self.sdt)
        share = pairs.view(mx.uint32).reshape(*lead, n // P, d)  # one word a channel
        if P * self.share > d:
            share = mx.pad(share, [(0, 0)] * (len(lead) + 1) + [(0, P * self.share - d)])
        share = share.reshape(*lead, n // P, P, self.share)
        words = mx.concatenate([packed.astype(mx.uint32), share], axis=-1)
        return read, words.reshape(*lead, n, self.ncodes + self.share)

    def _decode(self, words: mx.array) -> mx.array:
        *lead, n, w = words.shape
        P, d, per = self.block, self.d, 32 // self.bits
        rows = words.reshape(*lead, n // P, P, w)
        share = rows[..., self.ncodes:].reshape(*lead, n // P, P * self.share)[..., :d]
        pairs = share.view(self.sdt).reshape(*lead, n // P, d, 2).astype(mx.float32)
        scale, bias = pairs[..., None, :, 0], pairs[..., None, :, 1]
        mask = (1 << self.bits) - 1
        codes = (rows[..., : self.ncodes, None] >> (mx.arange(per, dtype=mx.uint32) * self.bits))
        codes = (codes & mask).reshape(*lead, n // P, P, d).astype(mx.float32)
        return (codes * scale + bias).reshape(*lead, n, d).astype(self.dtype)
