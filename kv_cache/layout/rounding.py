"""Float helpers of the page codec (``kv_cache.layout.quant``): powers of two from their bits,
and scales and biases rounded to a float16 (bfloat16) in the direction that keeps every value
of a group inside its range."""

from __future__ import annotations

import mlx.core as mx

MANTISSA = {mx.float16: 11, mx.bfloat16: 8}
_LIMIT = {mx.float16: 65504.0, mx.bfloat16: 3.0e38}


def _pow2(e: mx.array) -> mx.array:
    """``2.0 ** e`` for integer ``e`` in [-126, 127], built from its bits (exact everywhere)."""
    return ((e.astype(mx.int32) + 127) << 23).view(mx.float32)


def _floor_log2(r: mx.array) -> mx.array:
    """``floor(log2 r)`` of float32 ``r > 0`` from its exponent bits (-127 for 0/subnormals)."""
    return ((r.view(mx.int32) >> 23) - 127).astype(mx.float32)


def round_up(v: mx.array, bits: int, sdt: mx.Dtype) -> mx.array:
    """``v >= 0`` rounded up to ``bits`` significant bits, then to ``sdt`` (float32 result)."""
    e = mx.clip(_floor_log2(v) - (bits - 1), -126, 127)
    q = _pow2(e)
    s = mx.ceil(v / q) * q
    s = mx.minimum(mx.maximum(s, 2.0 ** -24 if sdt == mx.float16 else 1e-38), _LIMIT[sdt])
    return s.astype(sdt).astype(mx.float32)


def round_down(v: mx.array, sdt: mx.Dtype) -> mx.array:
    """The largest ``sdt`` value ``<= v`` (float32 result)."""
    v = mx.clip(v, -_LIMIT[sdt], _LIMIT[sdt])
    c = v.astype(sdt)
    bits = c.view(mx.uint16)
    neg = (bits >> 15) == 1
    down = mx.where(bits == 0, mx.array(0x8001, mx.uint16),
                    mx.where(neg, bits + 1, bits - 1)).view(sdt)
    return mx.where(c.astype(mx.float32) > v, down, c).astype(mx.float32)
