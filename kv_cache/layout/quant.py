"""KV pages in 8 or 4 bits: the page codec (``--kv-bits K[,V]``, ``--kv-group-size``).

Keys and values are quantized along ``head_dim`` in groups of ``group_size`` into MLX's affine
layout (packed ``uint32`` codes, one scale and one bias a group), so ``mx.dequantize`` and
``mx.quantized_matmul`` read them as they are. Keys and values may have their own bits
(``8,4``: keys suffer most from rounding, values least). With ``key_block`` (``--kv-key-scales
page``, the default where it applies) keys are instead coded per channel over a page
(``kv_cache.layout.channel_keys``), and a page's keys and values are coded when the page is full
(``seal``; ``kv_cache.model.channel_cache`` reads the open page as float).

Rotation (on by default): each group of a key or value is rotated before it is quantized,
``y = H (s * x) / g`` with ``H`` the ``g x g`` Sylvester Hadamard matrix (entries +-1) and ``s``
fixed signs, an orthogonal map up to the factor ``g``. It spreads an outlier channel over the
whole group, so the group's range, and with it the rounding step, shrinks. What a page gives
back is ``x = s * (H y)``: the model reads keys and values in their own basis, so its attention
is unchanged (the float path, any model, routed or not); attention that reads the packed codes
itself (``mx.quantized_matmul``) rotates the queries by ``H s`` and its output back instead
(``rotate_queries`` / ``unrotate``).

The one rule that makes a quantized cache exact (greedy output with the cache equals output
without it, a restored turn equals the warm one bit for bit): the page holds the integers and
scales as the truth, what the model reads of a fresh key is the decoded value of exactly those
integers and scales (``fresh``), and nothing decoded is quantized again (a commit writes the
codes ``fresh`` made, ``kv_cache.model.layer_cache``). So the scales need not be powers of two:
they are MLX's own affine scales, ``(max - bias) / levels``, rounded up to a float16 (bfloat16
for bfloat16 pages) with few enough significant bits that every product in the decode is exact:

- without rotation ``x = code * scale + bias``: the product is exact (code <= 8 bits, scale <=
  11), so the only rounding is the one addition, correctly rounded on every backend, fused or
  not;
- with rotation ``x = s * (H (code * scale + bias))`` is computed as ``s * (scale * (codes @ H) +
  bias * g * e0)``: ``codes @ H`` sums integers below ``2**24`` (exact in float32 in any order,
  so any BLAS, GEMV or GPU kernel gives the same), ``scale`` keeps at most ``24 - log2(g *
  levels)`` significant bits so ``scale * I`` is exact, ``H``'s first column is all ones and the
  others sum to zero, so only channel 0 of a group adds the bias (one rounding) and the others
  are exact products;
- with shaped keys (``kv_cache.layout.key_shape``: ``x = w * x' + m``, ``w`` of 3 significant
  bits, ``m`` a float16 value) the scales give up 3 more bits, each product times ``w`` stays
  exact, and the decode is ``(P + B) + m``: the two sums round, in that order, on every backend.

Hence the decoded floats depend only on the stored bits, never on the shape, batch or kernel
that decodes them: a fresh key, a gathered page, a prefix view and a restored page agree bit for
bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kv_cache.layout import channel_keys
from kv_cache.layout.key_shape import D_BITS, KeyShape
from kv_cache.layout.rounding import MANTISSA, round_down, round_up

QuantizedKV = tuple[mx.array, mx.array, mx.array]  # packed codes, scales, biases

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
ROTATION = "hadamard-signs-v1"  # the rotation's name in the description (change it with H or s)
SCALES = "affine-exact-v2"  # scales stored as the truth, rounded so that the decode is exact


__all__ = ["KVQuant", "QuantizedKV", "make_quant", "parse_bits", "scale_dtype"]

_COMPILED: dict = {}


def scale_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """The dtype of scales and biases for pages of values in ``dtype``: float16, or bfloat16
    for bfloat16 values (whose range float16 does not cover)."""
    return mx.bfloat16 if dtype == mx.bfloat16 else mx.float16


@dataclass(frozen=True, slots=True)
class KVQuant:
    """How pages are quantized: ``bits`` per key, ``value_bits`` per value (0: as keys), one
    scale and bias per ``group_size`` values, each group rotated first unless ``rotate`` is
    off."""

    bits: int
    group_size: int = 64
    value_bits: int = 0
    rotate: bool = True
    keys: KeyShape | None = None  # keys shaped before they are quantized (``key_shape``)
    key_block: int = 0  # keys per channel over pages of this many positions (``channel_keys``)

    def __post_init__(self):
        if not self.value_bits:
            object.__setattr__(self, "value_bits", self.bits)
        for b in (self.bits, self.value_bits):
            if b not in BITS:
                raise ValueError(f"--kv-bits must be one of {BITS}, not {b}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"--kv-group-size must be one of {GROUP_SIZES}, not "
                             f"{self.group_size}")
        if self.key_block and self.keys is not None:
            raise ValueError("keys per channel over a page are not shaped (--kv-calibration)")

    @property
    def key_bits(self) -> int:
        return self.bits

    @property
    def levels(self) -> int:
        """Levels of the keys' codes."""
        return (1 << self.bits) - 1

    def check(self, head_dim: int) -> None:
        """``ValueError`` unless ``head_dim`` is a whole number of groups."""
        if head_dim % self.group_size:
            raise ValueError(f"--kv-group-size {self.group_size} does not divide the model's "
                             f"head_dim {head_dim}")

    def describe(self) -> dict[str, Any]:
        """What enters the model's fingerprint (pages of different settings never mix)."""
        return {"kv_bits": self.bits, "kv_value_bits": self.value_bits,
                "kv_group_size": self.group_size, "kv_scales": SCALES,
                "kv_rotation": ROTATION if self.rotate else "none",
                **({"kv_key_scales": f"channel-page-{self.key_block}"} if self.key_block else {}),
                **(self.keys.describe() if self.keys is not None else {})}

    @classmethod
    def from_description(cls, d: dict[str, Any]) -> "KVQuant":
        block = int(d["kv_key_scales"].rsplit("-", 1)[1]) if "kv_key_scales" in d else 0
        return cls(int(d["kv_bits"]), int(d["kv_group_size"]), int(d["kv_value_bits"]),
                   d["kv_rotation"] != "none", key_block=block)

    def label(self) -> str:
        """``8``, ``8,4``, with ``/g32`` and ``/plain`` where not the defaults."""
        s = str(self.bits) if self.bits == self.value_bits else f"{self.bits},{self.value_bits}"
        return s + ("" if self.group_size == 64 else f"/g{self.group_size}") \
            + ("" if self.rotate else "/plain") + ("/channel" if self.key_block else "")

    # -- sizes ------------------------------------------------------------------------------------

    def side_words(self, bits: int, head_dim: int, dtype: mx.Dtype) -> int:
        """``uint32`` words of one position of one head, keys or values: codes, then scales and
        biases (their bits)."""
        groups = head_dim // self.group_size
        return head_dim * bits // 32 + groups * 2 * scale_dtype(dtype).size // 4

    def key_words(self, head_dim: int, dtype: mx.Dtype) -> int:
        """Words of one position's key of one head (per channel: codes and a scale share)."""
        if self.key_block:
            return channel_keys.key_words(head_dim, self.bits, self.key_block)
        return self.side_words(self.bits, head_dim, dtype)

    def kv_bytes(self, head_dim: int, dtype: mx.Dtype) -> int:
        """Bytes of one position of one head, its key and its value (an even number of words:
        a row is cut in two halves)."""
        w = self.key_words(head_dim, dtype) + self.side_words(self.value_bits, head_dim, dtype)
        return 4 * (w + w % 2)

    def page_bytes(self, layers: int, kv_heads: int, head_dim: int, n: int,
                   dtype: mx.Dtype) -> int:
        """Bytes of a page of ``n`` positions held quantized."""
        return layers * kv_heads * n * self.kv_bytes(head_dim, dtype)

    def words(self, head_dim: int, dtype: mx.Dtype) -> int:
        """The last axis of a stored page ``[layers, 2, kv_heads, n, words]``: a position's key
        words then its value words, cut in two halves (one per index of axis 1; with equal bits
        the halves are the key's and the value's own)."""
        return self.kv_bytes(head_dim, dtype) // 8

    # -- the codec, compiled per setting and dtype ------------------------------------------------

    def _fns(self, dtype: mx.Dtype, head_dim: int):
        key = (self, dtype, head_dim)
        fns = _COMPILED.get(key)
        if fns is None:
            fns = _COMPILED[key] = Codec(self, dtype, head_dim)
        return fns

    def fresh(self, keys: mx.array, values: mx.array, slot: int | None = None
              ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """New keys and values ``[..., kv_heads, n, head_dim]`` of the model's cache slot
        ``slot`` (with shaped keys; None: ``[layers, kv_heads, n, head_dim]`` of the whole
        group): what the model reads of them (the decoded values of their codes, in their dtype)
        and their stored words (key words, value words), in one compiled call. With
        ``key_block``: they are read as they are until their page is full (``seal``), and have
        no words yet (None)."""
        self.check(keys.shape[-1])
        if self.key_block:  # float until their page is full (seal): no words yet
            return keys, values, None, None
        fns = self._fns(keys.dtype, keys.shape[-1])
        if self.keys is None:
            return fns.fresh(keys, values)
        return fns.fresh(keys, values, *self.keys.layer(slot))

    def _widths(self, keys: mx.array) -> tuple[int, int]:
        d, dt = keys.shape[-1], keys.dtype
        return self.key_words(d, dt), self.side_words(self.value_bits, d, dt)

    def seal(self, keys: mx.array, values: mx.array) -> tuple[mx.array, ...]:
        """With ``key_block``: whole pages of float keys and values ``[..., n, head_dim]``
        coded as a full page holds them (keys per channel over the page, values per position):
        what the model reads of them, and their words (``(keys, values, key words, value
        words)``)."""
        k, kw = channel_keys.seal(keys, self.bits, self.key_block)
        v, vw = self._fns(values.dtype, values.shape[-1]).fresh_values(values)
        return k, v, kw, vw

    def round_trip_pair(self, keys: mx.array, values: mx.array, slot: int | None = None
                        ) -> tuple[mx.array, mx.array]:
        """What the model reads of new keys and values (``fresh`` without the words)."""
        k, v, _, _ = self.fresh(keys, values, slot)
        return k, v

    def round_trip(self, x: mx.array, slot: int | None = None) -> mx.array:
        """What the model reads of new keys ``x`` (key bits)."""
        return self.round_trip_pair(x, x, slot)[0]

    def join(self, key_words: mx.array, value_words: mx.array) -> mx.array:
        """Key words ``[..., n, wk]`` and value words ``[..., n, wv]`` (leading axes: kv heads)
        as stored rows ``[..., 2, heads, n, words]``."""
        if key_words.shape[-1] == value_words.shape[-1]:
            return mx.stack([key_words, value_words], axis=-4)
        both = mx.concatenate([key_words, value_words], axis=-1)
        if both.shape[-1] % 2:
            both = mx.pad(both, [(0, 0)] * (both.ndim - 1) + [(0, 1)])
        half = both.shape[-1] // 2
        return mx.stack([both[..., :half], both[..., half:]], axis=-4)

    def split(self, page: mx.array, head_dim: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Stored rows ``[..., 2, heads, n, words]`` as (key words, value words)."""
        k, v = page[..., 0, :, :, :], page[..., 1, :, :, :]
        wk = self.key_words(head_dim, dtype)
        wv = self.side_words(self.value_bits, head_dim, dtype)
        if wk == wv == k.shape[-1]:
            return k, v
        both = mx.concatenate([k, v], axis=-1)
        return both[..., :wk], both[..., wk : wk + wv]

    def encode(self, kv: mx.array) -> mx.array:
        """Values ``[..., 2, heads, n, head_dim]`` quantized as a page stores them (the words
        ``fresh`` gives)."""
        keys, values = kv[..., 0, :, :, :], kv[..., 1, :, :, :]
        if not self.key_block:
            _, _, kw, vw = self.fresh(keys, values)
            return self.join(kw, vw)
        n = keys.shape[-2]
        whole = n // self.key_block * self.key_block
        wk, wv = self._widths(keys)
        kw = mx.zeros((*keys.shape[:-2], n - whole, wk), mx.uint32)  # an open page: no codes
        vw = mx.zeros((*keys.shape[:-2], n - whole, wv), mx.uint32)
        if whole:  # whole pages, coded as sealed
            _, _, skw, svw = self.seal(keys[..., :whole, :], values[..., :whole, :])
            kw, vw = mx.concatenate([skw, kw], axis=-2), mx.concatenate([svw, vw], axis=-2)
        return self.join(kw, vw)

    def decode(self, page: mx.array, dtype: mx.Dtype, head_dim: int | None = None) -> mx.array:
        """The values a stored ``page`` holds ``[..., 2, heads, n, head_dim]``, in ``dtype``
        (the model's): bit for bit what ``fresh`` gave the model."""
        if head_dim is None:
            head_dim = self._dim(page.shape[-1], lambda d: self.words(d, dtype))
        fns = self._fns(dtype, head_dim)
        return fns.decode(page) if self.keys is None else fns.decode(page, *self.keys.layer(None))

    def _dim(self, words: int, width) -> int:
        """The head_dim whose ``width(head_dim)`` is ``words`` (a page's last axis)."""
        for d in range(self.group_size, 4097, self.group_size):
            if width(d) == words:
                return d
        raise ValueError(f"no head_dim gives {words} words")

    # -- packed attention (mx.quantized_matmul) ----------------------------------------------------

    def packed(self, words: mx.array, bits: int, dtype: mx.Dtype) -> QuantizedKV:
        """One side's words ``[..., w]`` as MLX's ``(codes, scales, biases)`` of the rotated
        values (what ``mx.quantized_matmul`` reads; scales and biases in ``dtype``)."""
        head_dim = self._dim(words.shape[-1], lambda d: self.side_words(bits, d, dtype))
        n = head_dim * bits // 32
        sb = words[..., n:].view(scale_dtype(dtype)).astype(dtype)
        g = head_dim // self.group_size
        return words[..., :n], sb[..., :g], sb[..., g:]

    def rotate_queries(self, q: mx.array) -> mx.array:
        """Queries ``[..., head_dim]`` in the basis the codes hold (``q . x == rotated(q) . y``);
        unchanged without rotation."""
        return self._fns(q.dtype, q.shape[-1]).rotate_queries(q) if self.rotate else q

    def unrotate(self, out: mx.array) -> mx.array:
        """A weighted sum of rotated values ``[..., head_dim]`` back in the model's basis."""
        return self._fns(out.dtype, out.shape[-1]).unrotate(out) if self.rotate else out


# -- the codec's compiled functions (``Codec``), and the fixed rotation they use -------------------


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


def parse_bits(text: str | int | tuple | None) -> tuple[int, int] | None:
    """``--kv-bits``: ``8``, ``4`` or ``K,V`` (``8,4``); None, 0 or ``off``: full precision.
    ``ValueError`` for anything else."""
    if text is None or text == 0 or (isinstance(text, str) and text.strip().lower() in
                                     ("", "0", "off", "none")):
        return None
    if isinstance(text, int):
        parts = [text]
    elif isinstance(text, (tuple, list)):
        parts = list(text)
    else:
        try:
            parts = [int(p) for p in text.split(",")]
        except ValueError:
            raise ValueError(f"--kv-bits wants 8, 4 or K,V such as 8,4, not {text!r}")
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or any(int(p) not in BITS for p in parts):
        raise ValueError(f"--kv-bits wants bits in {BITS} for keys and values (8, 4 or K,V "
                         f"such as 8,4), not {text!r}")
    return int(parts[0]), int(parts[1])


def make_quant(bits: int | str | tuple | None, group_size: int = 64,
               rotate: bool = True) -> KVQuant | None:
    """The codec for ``--kv-bits`` (None or 0: pages at the model's precision)."""
    kv = parse_bits(bits)
    return KVQuant(kv[0], group_size, kv[1], rotate) if kv else None
