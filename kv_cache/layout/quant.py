"""KV pages in 8 or 4 bits: the page codec (``--kv-bits K[,V]``).

Keys and values are quantized along ``head_dim`` in groups of ``group_size`` (64, or 32 where
64 does not divide the model's ``head_dim``: ``group_size_for``; groups of 32 measured no better
once rotated, in an earlier run of benchmarks/kv_quality.py: docs/BENCHMARKS.md's git history)
in MLX's affine layout (packed ``uint32`` codes, one scale and one bias a group). Keys and values
may have their own bits (``8,4``: keys suffer most from rounding, values least). With
``key_block`` (the default where it applies: ``kv_cache.layout.spec.key_block_for``) keys are
instead coded per channel over a page (``kv_cache.layout.channel_keys``), and a page's keys and
values are coded when the page is full (``seal``; ``kv_cache.model.channel_cache`` reads the
open page as float).

Rotation (always): each group of a key or value is rotated before it is quantized,
``y = H (s * x) / g`` with ``H`` the ``g x g`` Sylvester Hadamard matrix (entries +-1) and ``s``
fixed signs, an orthogonal map up to the factor ``g``. It spreads an outlier channel over the
whole group, so the group's range, and with it the rounding step, shrinks (4-bit keys: +6.2%
perplexity rotated against +14.5% not, in the same run). What a page gives back is
``x = s * (H y)``: the model reads keys and values in their own basis, so its attention is
unchanged (any model, routed or not).

The one rule that makes a quantized cache exact (greedy output with the cache equals output
without it, a restored turn equals the warm one bit for bit): the page holds the integers and
scales as the truth, what the model reads of a fresh key is the decoded value of exactly those
integers and scales (``fresh``), and nothing decoded is quantized again (a commit writes the
codes ``fresh`` made, ``kv_cache.model.layer_cache``). So the scales need not be powers of two:
they are MLX's own affine scales, ``(max - bias) / levels``, rounded up to a float16 (bfloat16
for bfloat16 pages) with few enough significant bits that every product in the decode is exact.
``x = s * (H (code * scale + bias))`` is computed as ``s * (scale * (codes @ H) + bias * g *
e0)``: ``codes @ H`` sums integers below ``2**24`` (exact in float32 in any order, so any BLAS,
GEMV or GPU kernel gives the same), ``scale`` keeps at most ``24 - log2(g * levels)``
significant bits so ``scale * I`` is exact, ``H``'s first column is all ones and the others sum
to zero, so only channel 0 of a group adds the bias (one rounding) and the others are exact
products.

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
from kv_cache.layout.rounding import MANTISSA, round_down, round_up

BITS = (4, 8)
GROUP_SIZES = (64, 32)  # the first that divides a model's head_dim (``group_size_for``)
ROTATION = "hadamard-signs-v1"  # the rotation's name in the description (change it with H or s)
SCALES = "affine-exact-v2"  # scales stored as the truth, rounded so that the decode is exact


__all__ = ["KVQuant", "group_size_for", "make_quant", "parse_bits", "scale_dtype"]

_COMPILED: dict = {}


def scale_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """The dtype of scales and biases for pages of values in ``dtype``: float16, or bfloat16
    for bfloat16 values (whose range float16 does not cover)."""
    return mx.bfloat16 if dtype == mx.bfloat16 else mx.float16


@dataclass(frozen=True, slots=True)
class KVQuant:
    """How pages are quantized: ``bits`` per key, ``value_bits`` per value (0: as keys), one
    scale and bias per ``group_size`` values, each group rotated first."""

    bits: int
    group_size: int = 64
    value_bits: int = 0
    key_block: int = 0  # keys per channel over pages of this many positions (``channel_keys``)

    def __post_init__(self):
        if not self.value_bits:
            object.__setattr__(self, "value_bits", self.bits)
        for b in (self.bits, self.value_bits):
            if b not in BITS:
                raise ValueError(f"--kv-bits must be one of {BITS}, not {b}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"groups of {self.group_size}: the page codec takes groups of "
                             f"{' or '.join(map(str, GROUP_SIZES))}")

    def check(self, head_dim: int) -> None:
        """``ValueError`` unless ``head_dim`` is a whole number of groups."""
        if head_dim % self.group_size:
            raise ValueError(f"groups of {self.group_size} do not divide the model's head_dim "
                             f"{head_dim}")

    def describe(self) -> dict[str, Any]:
        """What enters the model's fingerprint (pages of different settings never mix). NOTE:
        the same words as before the rotation and the group size stopped being settings, so
        pages written then still restore (tests/kv_cache/layout/test_spec.py)."""
        return {"kv_bits": self.bits, "kv_value_bits": self.value_bits,
                "kv_group_size": self.group_size, "kv_scales": SCALES, "kv_rotation": ROTATION,
                **({"kv_key_scales": f"channel-page-{self.key_block}"} if self.key_block else {})}

    @classmethod
    def from_description(cls, d: dict[str, Any]) -> "KVQuant":
        """The codec ``describe`` gave ``d``; ``ValueError`` for a codec this version does not
        hold pages in (not rotated, or keys shaped by calibration: settings that are gone)."""
        if d.get("kv_rotation") != ROTATION or "kv_key_shape" in d:
            raise ValueError(f"pages coded as {d.get('kv_rotation')!r}"
                             f"{' with shaped keys' if 'kv_key_shape' in d else ''}: not a "
                             "codec of this version")
        block = int(d["kv_key_scales"].rsplit("-", 1)[1]) if "kv_key_scales" in d else 0
        return cls(int(d["kv_bits"]), int(d["kv_group_size"]), int(d["kv_value_bits"]),
                   key_block=block)

    def label(self) -> str:
        """``8``, ``8,4``, with ``/g32`` where not the default and ``/channel`` with
        ``key_block``."""
        s = str(self.bits) if self.bits == self.value_bits else f"{self.bits},{self.value_bits}"
        return s + ("" if self.group_size == 64 else f"/g{self.group_size}") \
            + ("/channel" if self.key_block else "")

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

    def fresh(self, keys: mx.array, values: mx.array
              ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """New keys and values ``[..., kv_heads, n, head_dim]``: what the model reads of them
        (the decoded values of their codes, in their dtype) and their stored words (key words,
        value words), in one compiled call. With ``key_block``: they are read as they are until
        their page is full (``seal``), and have no words yet (None)."""
        self.check(keys.shape[-1])
        if self.key_block:  # float until their page is full (seal): no words yet
            return keys, values, None, None
        return self._fns(keys.dtype, keys.shape[-1]).fresh(keys, values)

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

    def round_trip_pair(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """What the model reads of new keys and values (``fresh`` without the words)."""
        k, v, _, _ = self.fresh(keys, values)
        return k, v

    def round_trip(self, x: mx.array) -> mx.array:
        """What the model reads of new keys ``x`` (key bits)."""
        return self.round_trip_pair(x, x)[0]

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

    def decode(self, page: mx.array, dtype: mx.Dtype, head_dim: int) -> mx.array:
        """The values a stored ``page`` holds ``[..., 2, heads, n, head_dim]``, in ``dtype``
        (the model's): bit for bit what ``fresh`` gave the model."""
        return self._fns(dtype, head_dim).decode(page)


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

        def fresh(keys, values):
            k, kw = self._side(keys, q.bits)
            v, vw = self._side(values, q.value_bits)
            return k, v, kw, vw

        def decode(page):
            if q.key_block:
                kw, vw = q.split(page, head_dim, dtype)
                return mx.stack([channel_keys.decode(kw, q.bits, q.key_block, dtype, head_dim),
                                 self._decode_words(vw, q.value_bits)], axis=-4)
            if q.bits == q.value_bits:  # the halves are the keys' and the values' own words
                return self._decode_words(page, q.bits)
            kw, vw = q.split(page, head_dim, dtype)
            return mx.stack([self._decode_words(kw, q.bits),
                             self._decode_words(vw, q.value_bits)], axis=-4)

        self.fresh = mx.compile(fresh)
        self.fresh_values = mx.compile(lambda values: self._side(values, q.value_bits))
        self.decode = mx.compile(decode)

    def _mantissa(self, bits: int) -> int:
        """Significant bits a scale keeps so that ``scale * (codes @ H)`` is exact in float32."""
        top = self.q.group_size * ((1 << bits) - 1)
        return min(MANTISSA[self.sdt], 24 - math.ceil(math.log2(top + 1)))

    def _side(self, x: mx.array, bits: int) -> tuple[mx.array, mx.array]:
        """Keys or values ``[..., head_dim]``: what the model reads, and their words."""
        g, levels = self.q.group_size, (1 << bits) - 1
        y = x.astype(mx.float32)
        y = ((y * self.signs).reshape(*x.shape[:-1], -1, g) @ self.h) * (1.0 / g)
        lo, hi = y.min(axis=-1, keepdims=True), y.max(axis=-1, keepdims=True)
        bias = round_down(lo, self.sdt)
        scale = round_up((hi - bias) * (1.0 / levels), self._mantissa(bits), self.sdt)
        codes = mx.clip(mx.round((y - bias) / scale), 0, levels)
        read = self._values(codes, scale, bias, x.shape)
        per = 32 // bits
        c = codes.astype(mx.uint32).reshape(*x.shape[:-1], -1, per)
        packed = (c << (mx.arange(per, dtype=mx.uint32) * bits)).sum(axis=-1).astype(mx.uint32)
        sb = mx.concatenate([scale[..., 0], bias[..., 0]], axis=-1).astype(self.sdt)
        return read, mx.concatenate([packed, sb.view(mx.uint32)], axis=-1)

    def _values(self, codes: mx.array, scale: mx.array, bias: mx.array,
                shape: tuple[int, ...]) -> mx.array:
        """Codes ``[..., groups, g]`` (float32 integers), scales and biases ``[..., groups, 1]``
        as the model reads them: exact products, one rounding (see the module's note)."""
        # NOTE: codes @ H sums integers < 2**24: exact, whatever the kernel's order.
        x = scale * (codes @ self.h) + bias * self.e0
        return (x.reshape(shape) * self.signs).astype(self.dtype)

    def _decode_words(self, words: mx.array, bits: int) -> mx.array:
        g, per, mask = self.q.group_size, 32 // bits, (1 << bits) - 1
        lead, n = words.shape[:-1], self.d * bits // 32
        groups = self.d // g
        sb = words[..., n:].view(self.sdt).astype(mx.float32)
        codes = (words[..., :n, None] >> (mx.arange(per, dtype=mx.uint32) * bits)) & mask
        codes = codes.reshape(*lead, groups, g).astype(mx.float32)
        return self._values(codes, sb[..., :groups, None], sb[..., groups:, None],
                            (*lead, self.d))


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


def group_size_for(head_dims) -> int:
    """The group size of pages in bits for a model whose paged groups have ``head_dims``: 64,
    or 32 where 64 does not divide one of them (groups of 32 cost bytes and measured no better
    once rotated: 4-bit keys +6.3% against +6.2%, an earlier run of benchmarks/kv_quality.py in
    docs/BENCHMARKS.md's git history)."""
    dims = list(head_dims)
    for g in GROUP_SIZES:
        if all(d % g == 0 for d in dims):
            return g
    raise ValueError(f"--kv-bits needs a head_dim that is a multiple of "
                     f"{min(GROUP_SIZES)}, not {', '.join(map(str, sorted(set(dims))))}")


def make_quant(bits: int | str | tuple | None, group_size: int = 64) -> KVQuant | None:
    """The codec for ``--kv-bits`` (None or 0: pages at the model's precision)."""
    kv = parse_bits(bits)
    return KVQuant(kv[0], group_size, kv[1]) if kv else None
