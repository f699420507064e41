"""KV pages in 8 or 4 bits: the page codec (``--kv-bits``, ``--kv-group-size``).

A page's keys and values are quantized along ``head_dim`` in groups of ``group_size`` into
MLX's affine layout (packed ``uint32`` codes, one scale and one bias per group, in the page's
dtype), so ``mx.dequantize`` and ``mx.quantized_matmul`` read them as they are.

The one rule that makes a quantized cache exact (greedy output with the cache equals output
without it, a restored turn equals the warm one): what the model reads is exactly the
dequantized value of what is stored, for fresh keys and values too. A layer cache therefore
passes every new key and value through ``round_trip`` before attention reads it, and the pool
later quantizes those very values for its page. That only reproduces them if the round trip is
a projection: ``round_trip(round_trip(x)) == round_trip(x)`` bit for bit. ``mx.quantize`` is
not one (its scale is ``(max - min) / levels``, recomputed from rounded values it comes out a
few ulps off: measured on MLX 0.32's CPU backend, 8 and 4 bits, float32/16 and bfloat16).

So the codec picks its own scales: powers of two, ``s = 2**e`` with the smallest ``e`` such
that the group's integers ``round(x / s)`` span at most ``2**bits - 1`` levels and stay within
the dtype's exact integer range; the bias is ``round(min / s) * s``. Every dequantized value is
then ``integer * 2**e``, computed exactly in any precision; re-quantizing it finds the same or a
smaller power of two (which divides the old one), hence the same values. The price is up to one
bit of range in the worst group (about 1.4x the error of ``mx.quantize`` on average), the gain
is exactness on every backend, since nothing depends on how a kernel rounds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

QuantizedKV = tuple[mx.array, mx.array, mx.array]  # packed codes, scales, biases

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
_SIGNIFICAND = {mx.float32: 24, mx.float16: 11, mx.bfloat16: 8}  # exact integers: 2**p
_MIN_EXP = {mx.float32: -126, mx.float16: -14, mx.bfloat16: -126}  # smallest normal power


def _pow2(e: mx.array) -> mx.array:
    """``2.0 ** e`` for integer ``e`` in [-126, 127], built from its bits (exact everywhere)."""
    return ((e.astype(mx.int32) + 127) << 23).view(mx.float32)


def _floor_log2(r: mx.array) -> mx.array:
    """``floor(log2 r)`` of float32 ``r >= 0``, exactly, from its exponent bits (-127 for 0)."""
    return ((r.view(mx.int32) >> 23) - 127).astype(mx.float32)


def _grouped(x: mx.array, levels: int, top: float, min_exp: int) -> tuple[mx.array, mx.array]:
    """Per group of float32 ``x`` ``[..., groups, group_size]``: the integers ``round(x / s)``
    and ``s = 2**e`` for the smallest feasible ``e >= min_exp``.

    Feasible: ``round(hi/s) - round(lo/s) <= levels`` and ``|round(lo|hi / s)| <= top``.
    Any feasible ``s`` is at least ``r = max(range / (levels + 1), |x| / (top + 1))``, so
    ``floor(log2 r)`` bounds ``e`` from below; feasibility is monotone in ``e`` and holds from
    ``s >= 2r`` on, so ``e`` is that bound plus the number of infeasible ones of the next two.
    NOTE: the smallest feasible exponent of ``round_trip(x)`` is never above that of ``x``
    (``x``'s own one is feasible for it), which is what makes the round trip a projection.
    """
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    r = mx.maximum((hi - lo) * (1 / (levels + 1)), mx.maximum(-lo, hi) * (1 / (top + 1)))
    e = mx.maximum(_floor_log2(r), min_exp)
    e0 = e
    for j in range(2):
        inv = _pow2(-(e0 + j))
        a, b = mx.round(lo * inv), mx.round(hi * inv)
        e = e + ((b - a > levels) | (mx.maximum(-a, b) > top))
    return mx.round(x * _pow2(-e)), _pow2(e)


_COMPILED: dict = {}


def _round_trip_fn(bits: int, group_size: int, dtype: mx.Dtype):
    """The round trip of a layer's new keys and values for one setting, compiled: it runs for
    every layer of every decode step, and fused its dozens of small operations cost about one
    pass (measured on the CPU backend: ~60 us a layer for keys and values together, ~130 us
    for them apart, several times that as separate operations)."""
    key = (bits, group_size, dtype)
    fn = _COMPILED.get(key)
    if fn is None:
        levels, top, low = (1 << bits) - 1, float(1 << _SIGNIFICAND[dtype]), _MIN_EXP[dtype]

        def one(kv: mx.array) -> mx.array:
            x = kv.astype(mx.float32).reshape(*kv.shape[:-1], -1, group_size)
            n, s = _grouped(x, levels, top, low)
            # NOTE: + 0.0 turns -0 into +0, as dequantize's ``code * scale + bias`` gives it.
            return (n * s + 0.0).reshape(kv.shape).astype(kv.dtype)

        def pair(keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
            both = one(mx.stack([keys, values]))  # one graph: half the cost of two
            return both[0], both[1]

        fn = _COMPILED[key] = (mx.compile(one), mx.compile(pair))
    return fn


def _decode_fn(bits: int, group_size: int, dtype: mx.Dtype):
    key = ("decode", bits, group_size, dtype)
    fn = _COMPILED.get(key)
    if fn is None:
        per, mask = 32 // bits, (1 << bits) - 1

        def decode(page: mx.array) -> mx.array:
            words = page.shape[-1]
            groups = words * 32 // (group_size * bits + 16 * dtype.size)
            n_codes = groups * group_size * bits // 32
            sb = page[..., n_codes:].view(dtype).astype(mx.float32)
            codes = (page[..., :n_codes, None] >> (mx.arange(per, dtype=mx.uint32) * bits)) & mask
            codes = codes.reshape(*page.shape[:-1], groups, group_size).astype(mx.float32)
            # NOTE: code * 2**e + bias is exact in float32 (see the module's note): the same
            # values as mx.dequantize, in any order of operations.
            x = codes * sb[..., :groups, None] + sb[..., groups:, None]
            return x.reshape(*page.shape[:-1], groups * group_size).astype(dtype)

        fn = _COMPILED[key] = mx.compile(decode)
    return fn


@dataclass(frozen=True, slots=True)
class KVQuant:
    """How pages are quantized: ``bits`` per value, one scale and bias per ``group_size``."""

    bits: int
    group_size: int = 64

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"--kv-bits must be one of {BITS}, not {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"--kv-group-size must be one of {GROUP_SIZES}, not "
                             f"{self.group_size}")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def check(self, head_dim: int) -> None:
        """``ValueError`` unless ``head_dim`` is a whole number of groups."""
        if head_dim % self.group_size:
            raise ValueError(f"--kv-group-size {self.group_size} does not divide the model's "
                             f"head_dim {head_dim}")

    def describe(self) -> dict[str, Any]:
        """What enters the model's fingerprint (pages of different settings never mix)."""
        return {"kv_bits": self.bits, "kv_group_size": self.group_size,
                "kv_scales": "pow2-affine-v1"}

    # -- sizes ------------------------------------------------------------------------------------

    def row_bytes(self, head_dim: int, dtype: mx.Dtype) -> int:
        """Bytes of one position of one head (codes, scales, biases)."""
        return head_dim * self.bits // 8 + 2 * (head_dim // self.group_size) * dtype.size

    def page_bytes(self, layers: int, kv_heads: int, head_dim: int, n: int,
                   dtype: mx.Dtype) -> int:
        """Bytes of a page ``[layers, 2, kv_heads, n, head_dim]`` held quantized."""
        return layers * 2 * kv_heads * n * self.row_bytes(head_dim, dtype)

    # -- codec ------------------------------------------------------------------------------------

    def _grouped(self, kv: mx.array) -> tuple[mx.array, mx.array]:
        x = kv.astype(mx.float32).reshape(*kv.shape[:-1], -1, self.group_size)
        return _grouped(x, self.levels, float(1 << _SIGNIFICAND[kv.dtype]), _MIN_EXP[kv.dtype])

    def quantize(self, kv: mx.array) -> QuantizedKV:
        """``kv`` (any shape, last axis ``head_dim``, float16/bfloat16/float32) in MLX's affine
        layout: ``uint32`` codes ``[..., head_dim * bits / 32]``, scales and biases
        ``[..., head_dim / group_size]`` in ``kv``'s dtype."""
        self.check(kv.shape[-1])
        n, s = self._grouped(kv)
        low = n.min(axis=-1, keepdims=True)
        per = 32 // self.bits
        codes = (n - low).astype(mx.uint32).reshape(*kv.shape[:-1], -1, per)
        shifts = mx.arange(per, dtype=mx.uint32) * self.bits
        packed = (codes << shifts).sum(axis=-1).astype(mx.uint32)  # disjoint bits: sum is OR
        return packed, s[..., 0].astype(kv.dtype), (low * s)[..., 0].astype(kv.dtype)

    def dequantize(self, q: QuantizedKV) -> mx.array:
        """The values ``q`` holds, in its scales' dtype (exact: every value is ``k * 2**e``)."""
        w, scales, biases = q
        return mx.dequantize(w, scales, biases, group_size=self.group_size, bits=self.bits)

    # -- a page as one array ------------------------------------------------------------------

    def words(self, head_dim: int, dtype: mx.Dtype) -> int:
        """``uint32`` words of one stored position of one head: codes, then scales and biases
        (their bits, in ``dtype``)."""
        return self.row_bytes(head_dim, dtype) // 4

    def encode(self, kv: mx.array) -> mx.array:
        """``kv`` ``[..., head_dim]`` as one ``uint32`` array ``[..., words]``: a stored page
        stays one array cut and joined along positions, read and written as it is by every tier
        (memory runs, disk files, the shared store, exports). Compiled: every commit runs it."""
        key = ("encode", self.bits, self.group_size, kv.dtype)
        fn = _COMPILED.get(key)
        if fn is None:
            def encode(kv: mx.array) -> mx.array:
                w, scales, biases = self.quantize(kv)
                sb = mx.concatenate([scales, biases], axis=-1).view(mx.uint32)
                return mx.concatenate([w, sb], axis=-1)

            fn = _COMPILED[key] = mx.compile(encode)
        return fn(kv)

    def decode(self, page: mx.array, dtype: mx.Dtype) -> mx.array:
        """The values an ``encode``d ``page`` holds, in ``dtype`` (the model's): exactly
        ``dequantize``'s, unpacked with shifts in one compiled pass (half the time of
        ``mx.dequantize`` on the CPU backend: ~90 against ~175 ms for 2,266 tokens of the
        default model, the bulk of a restore's cache step)."""
        return _decode_fn(self.bits, self.group_size, dtype)(page)

    def round_trip(self, kv: mx.array) -> mx.array:
        """Exactly ``dequantize(quantize(kv))``, without packing: what the model reads of a
        fresh key or value, and what the page will give back."""
        self.check(kv.shape[-1])
        return _round_trip_fn(self.bits, self.group_size, kv.dtype)[0](kv)

    def round_trip_pair(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """``round_trip`` of a layer's new keys and values, in one compiled call."""
        self.check(keys.shape[-1])
        if keys.shape != values.shape or keys.dtype != values.dtype:
            return self.round_trip(keys), self.round_trip(values)
        return _round_trip_fn(self.bits, self.group_size, keys.dtype)[1](keys, values)


def make_quant(bits: int | None, group_size: int = 64) -> KVQuant | None:
    """The codec for ``--kv-bits`` (None or 0: pages at the model's precision)."""
    return KVQuant(bits, group_size) if bits else None
