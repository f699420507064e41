"""A shared prefix in bits read as its pages store it: ``mx.quantized_matmul`` for q.K and p.V.

With pages in bits (``kv_cache.layout.quant``), a prefix view can hold its layers' keys and
values either decoded to float buffers (what the model reads of every other position: exact, the
same floats as the pages' fresh keys) or packed, as the pages hold them: MLX's affine layout
(codes, scales, biases) of the *rotated* values. Packed, the view takes 1/3.5 to 1/6.4 of the
memory of float32 buffers and attention reads fewer bytes, which is what a GPU is bound by in a
decode step; the split attention then computes the prefix's part as

    scores  = rotate(q) . Y^T           (``q . x == rotate(q) . y``: the rotation is orthogonal)
    out     = unrotate(p . Y)           (a weighted sum of rotated values, rotated back)

through ``mx.quantized_matmul``, which reads the codes as they are (mlx-lm's quantized
attention does the same for its own quantized caches). The sums then run in the kernel's order,
not the decoded path's, so the floats differ in their last bits from the decoded view's; what
the invariants need still holds: the choice depends only on the backend and the setting
(``packed_pays``), never on where the pages came from, so a restored turn reads the same bytes
the same way as the warm one, and each row of a batch is computed as alone.

Where: ``packed_pays`` says yes on a GPU (Metal, CUDA), no on the CPU, where decoding once into
the view's buffers is the faster one (measured: docs/BENCHMARKS.md section 14), and ``--kv-
attention packed|decoded`` overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from kv_cache.layout.quant import KVQuant, QuantizedKV
from kv_cache.layout.spec import GroupSpec

MODES = ("auto", "packed", "decoded")


def packed_pays(mode: str, quant: KVQuant | None) -> bool:
    """Whether prefix views of pages in ``quant`` are read packed (``mode``: ``auto`` is packed
    on a GPU, decoded on the CPU). Keys per channel over a page (``quant.key_block``) are read
    decoded: their scales run along positions, which ``mx.quantized_matmul`` does not read."""
    if mode not in MODES:
        raise ValueError(f"--kv-attention must be one of {MODES}, not {mode!r}")
    if quant is None or mode == "decoded" or quant.key_block:
        return False
    return mode == "packed" or mx.default_device().type == mx.DeviceType.gpu


@dataclass(frozen=True, slots=True)
class PackedKV:
    """One layer's prefix as its pages store it: ``(codes, scales, biases)`` of the rotated
    keys and of the rotated values, each ``[kv_heads, length, ...]``."""

    keys: QuantizedKV
    values: QuantizedKV
    quant: KVQuant
    length: int
    shape: tuple = ()  # shaped keys: this layer's (offsets, weights) ``[kv_heads, 1, head_dim]``

    def head(self, n: int) -> "PackedKV":
        """The first ``n`` positions."""
        if n == self.length:
            return self
        return PackedKV(tuple(a[:, :n] for a in self.keys), tuple(a[:, :n] for a in self.values),
                        self.quant, n, self.shape)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values))

    def scores(self, q: mx.array) -> mx.array:
        """``q [kv_heads, M, head_dim]`` (scaled) against the keys: ``[kv_heads, M, length]``."""
        c = self.quant
        if not self.shape:
            return mx.quantized_matmul(c.rotate_queries(q), *self.keys, transpose=True,
                                       group_size=c.group_size, bits=c.bits)
        # keys held as (k - m) / w: q . k == (w q) . ((k - m) / w) + q . m
        off, w = self.shape
        s = mx.quantized_matmul(c.rotate_queries(q * w.astype(q.dtype)), *self.keys,
                                transpose=True, group_size=c.group_size, bits=c.bits)
        return s + (q * off.astype(q.dtype)).sum(axis=-1, keepdims=True)

    def weighted_values(self, p: mx.array) -> mx.array:
        """``p [kv_heads, M, length]`` times the values, in the model's basis: ``[kv_heads, M,
        head_dim]``."""
        c = self.quant
        out = mx.quantized_matmul(p, *self.values, transpose=False, group_size=c.group_size,
                                  bits=c.value_bits)
        return c.unrotate(out)


def packed_layers(group: GroupSpec, rows: mx.array) -> list[PackedKV]:
    """A group's gathered pages ``[layers, 2, kv_heads, n, words]`` as one ``PackedKV`` a
    layer (scales and biases in the model's dtype, as ``mx.quantized_matmul`` takes them)."""
    q, dtype, n = group.quant, group.mx_dtype, rows.shape[3]
    kw, vw = q.split(rows, group.head_dim, dtype)
    keys = q.packed(kw, q.bits, dtype)
    values = q.packed(vw, q.value_bits, dtype)
    return [PackedKV(tuple(a[i] for a in keys), tuple(a[i] for a in values), q, n,
                     q.keys.layer(slot) if q.keys is not None else ())
            for i, slot in enumerate(group.layers)]


def prefix_length(prefix) -> int:
    """Positions of a prefix, decoded ``(K, V)`` or ``PackedKV``."""
    return prefix.length if isinstance(prefix, PackedKV) else prefix[0].shape[1]
