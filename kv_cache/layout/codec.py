"""The compiled functions of the page codec (``kv_cache.layout.quant``): one per setting,
dtype and head_dim, and the fixed rotation they use."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import mlx.core as mx

from kv_cache.layout import channel_keys
from kv_cache.layout.key_shape import D_BITS
from kv_cache.layout.rounding import MANTISSA, round_down, round_up

if TYPE_CHECKING:
    from kv_cache.layout.quant import KVQuant

def scale_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """The dtype of scales and biases for pages of values in ``dtype``: float16, or bfloat16
    for bfloat16 values (whose range float16 does not cover)."""
    return mx.bfloat16 if dtype == mx.bfloat16 else mx.float16


def _signs(n: int) -> list[float]:
    """Fixed +-1 signs, from a fixed 64-bit LCG (stable across Python, NumPy and MLX versions)."""
    out, state = [], 0x9E3779B97F4A7C15
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(1.0 if state >> 63 else -1.0)
    return out


def _hadamard(n: int) -> list[list[float]]:
    h = [[1.0]]
    while len(h) < n:
        h = [r + r for r in h] + [r + [-x for x in r] for r in h]
    return h


class Codec:
    """The compiled functions of one setting, dtype and head_dim."""

    def __init__(self, q: KVQuant, dtype: mx.Dtype, head_dim: int):
        self.q, self.dtype, self.d = q, dtype, head_dim
        g = q.group_size
        self.sdt = scale_dtype(dtype)
        self.signs = mx.array(_signs(head_dim), mx.float32)
        self.h = mx.array(_hadamard(g), mx.float32)
        self.e0 = (mx.arange(g) == 0).astype(mx.float32) * g  # sum of each column of H
        # NOTE: evaluated now: the codec is shared by threads, and an unevaluated array belongs
        # to the stream of the thread that made it (MLX 0.32: "no Stream(cpu, 0) in current
        # thread").
        mx.eval(self.signs, self.h, self.e0)

        def fresh(keys, values, *shape):
            k, kw = self._side(keys, q.bits, shape)
            v, vw = self._side(values, q.value_bits)
            return k, v, kw, vw

        def decode(page, *shape):
            if q.key_block:
                kw, vw = q.split(page, head_dim, dtype)
                return mx.stack([channel_keys.decode(kw, q.bits, q.key_block, dtype, head_dim),
                                 self._decode_words(vw, q.value_bits)], axis=-4)
            if q.bits == q.value_bits:  # the halves are the keys' and the values' own words
                if not shape:
                    return self._decode_words(page, q.bits)
                kw, vw = page[..., 0, :, :, :], page[..., 1, :, :, :]
            else:
                kw, vw = q.split(page, head_dim, dtype)
            return mx.stack([self._decode_words(kw, q.bits, shape),
                             self._decode_words(vw, q.value_bits)], axis=-4)

        def rotate_queries(x):
            y = (x.astype(mx.float32) * self.signs).reshape(*x.shape[:-1], -1, g) @ self.h
            return y.reshape(x.shape).astype(x.dtype)

        def unrotate(y):
            x = (y.astype(mx.float32).reshape(*y.shape[:-1], -1, g) @ self.h)
            return (x.reshape(y.shape) * self.signs).astype(y.dtype)

        self.fresh = mx.compile(fresh)
        self.fresh_values = mx.compile(lambda values: self._side(values, q.value_bits))
        self.decode = mx.compile(decode)
        self.rotate_queries = mx.compile(rotate_queries)
        self.unrotate = mx.compile(unrotate)

    def _mantissa(self, bits: int, shaped: bool = False) -> int:
        """Significant bits a scale keeps so that ``scale * (codes @ H)`` is exact in float32
        (times a shaped key's 3-bit channel weight: ``kv_cache.layout.key_shape``)."""
        top = self.q.group_size * ((1 << bits) - 1) if self.q.rotate else (1 << bits) - 1
        return min(MANTISSA[self.sdt], 24 - math.ceil(math.log2(top + 1))
                   - (D_BITS if shaped else 0))

    def _side(self, x: mx.array, bits: int, shape: tuple = ()) -> tuple[mx.array, mx.array]:
        """Keys or values ``[..., head_dim]``: what the model reads, and their words; ``shape``:
        the keys' ``(offsets, scales)`` (``kv_cache.layout.key_shape``)."""
        g, levels = self.q.group_size, (1 << bits) - 1
        y = x.astype(mx.float32)
        if shape:
            y = (y - shape[0]) / shape[1]
        if self.q.rotate:
            y = ((y * self.signs).reshape(*x.shape[:-1], -1, g) @ self.h) * (1.0 / g)
        else:
            y = y.reshape(*x.shape[:-1], -1, g)
        lo, hi = y.min(axis=-1, keepdims=True), y.max(axis=-1, keepdims=True)
        bias = round_down(lo, self.sdt)
        scale = round_up((hi - bias) * (1.0 / levels), self._mantissa(bits, bool(shape)),
                          self.sdt)
        codes = mx.clip(mx.round((y - bias) / scale), 0, levels)
        read = self._values(codes, scale, bias, x.shape, shape)
        per = 32 // bits
        c = codes.astype(mx.uint32).reshape(*x.shape[:-1], -1, per)
        packed = (c << (mx.arange(per, dtype=mx.uint32) * bits)).sum(axis=-1).astype(mx.uint32)
        sb = mx.concatenate([scale[..., 0], bias[..., 0]], axis=-1).astype(self.sdt)
        return read, mx.concatenate([packed, sb.view(mx.uint32)], axis=-1)

    def _values(self, codes: mx.array, scale: mx.array, bias: mx.array,
                shape: tuple[int, ...], key_shape: tuple = ()) -> mx.array:
        """Codes ``[..., groups, g]`` (float32 integers), scales and biases ``[..., groups, 1]``
        as the model reads them: exact products, one rounding (see the module's note); shaped
        keys: exact products, then ``(P + B) + offset``, two roundings in that order."""
        if key_shape:
            off, w = key_shape  # [..., 1, head_dim]: float16 offsets, 3-bit weights
            if self.q.rotate:
                # NOTE: codes @ H: exact integers; scale * I * (w * s): exact (the scale gave
                # up w's bits); bias * g * (w * s): exact; so only the two sums round.
                f = w * self.signs
                p = (scale * (codes @ self.h)).reshape(shape) * f
                b = (bias * self.e0).reshape(shape) * f
            else:
                p = (codes * scale).reshape(shape) * w
                b = mx.broadcast_to(bias, codes.shape).reshape(shape) * w
            return ((p + b) + off).astype(self.dtype)
        if self.q.rotate:
            # NOTE: codes @ H sums integers < 2**24: exact, whatever the kernel's order.
            x = scale * (codes @ self.h) + bias * self.e0
            x = x.reshape(shape) * self.signs
        else:
            x = (codes * scale + bias).reshape(shape)
        return x.astype(self.dtype)

    def _decode_words(self, words: mx.array, bits: int, shape: tuple = ()) -> mx.array:
        g, per, mask = self.q.group_size, 32 // bits, (1 << bits) - 1
        lead, n = words.shape[:-1], self.d * bits // 32
        groups = self.d // g
        sb = words[..., n:].view(self.sdt).astype(mx.float32)
        codes = (words[..., :n, None] >> (mx.arange(per, dtype=mx.uint32) * bits)) & mask
        codes = codes.reshape(*lead, groups, g).astype(mx.float32)
        return self._values(codes, sb[..., :groups, None], sb[..., groups:, None],
                            (*lead, self.d), shape)
