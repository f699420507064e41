"""Keys shaped before they are quantized: a per-channel offset and scale per layer and KV head.

A model's keys are far from centred: on the default model a channel's mean over positions
reaches 12 where its spread is 1.4 (post-RoPE keys, measured by ``kv_cache.model.calibrate``),
so a 4-bit group spends most of its range on an offset every position shares. Before the page
codec rotates and quantizes a key ``x`` it now takes

    x' = (x - m) / D

with ``m`` the channel's mean and ``D`` a channel weight, and the page gives back
``x = D * x'' + m`` (``x''`` the decoded ``x'``). ``D`` follows what a rounding error costs
attention: an error ``e`` in channel ``c`` moves a score by ``q_c e``, so channels whose queries
are small can be rounded coarsely; with the error spread evenly over a rotated group, the score's
error is least for ``D_c^2 ~ std(k_c) / rms(q_c)`` (Cauchy-Schwarz over the two sums).

``m`` is one vector per layer and head, and keys are stored after RoPE, so a channel pair whose
mean turns with the position (RoPE periods of 1,000-10,000 positions carry means of 4-6 on the
default model) is only partly served by it: calibration averages over the positions a long
conversation reaches (``kv_cache.model.calibrate``), which keeps the offsets of the pairs that
hardly turn (periods over 20,000 positions: means of 10-14) and lets the others go to zero.
Measured on the default model (docs/BENCHMARKS.md section 14): at 4 bits about a point less
perplexity over long contexts and a point more over short ones, so the server keeps it off
unless asked (``--kv-calibration on``).

Exactness (see ``kv_cache.layout.quant``): ``m`` is a float16 value and ``D`` has 3 significant
bits (``{1, 1.25, 1.5, 1.75} * 2**e``), so every product of the decode stays exact once the
scales give up 3 bits, and the decode is ``(P + B) + m``: two additions in a fixed order, each
correctly rounded, on any backend and kernel. ``m`` and ``D`` are calibrated once from a fixed
text when a model is opened (``kv_cache.model.calibrate``); their digest enters the model's
fingerprint, so pages shaped differently (another backend's calibration, another text) are a
clean miss, never mixed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping, Sequence

import mlx.core as mx
import numpy as np

SHAPE = "mean-offset-qweight-v1"  # the name of what m and D are (change it with their rule)
D_BITS = 3  # significant bits of a channel weight: the scales give these up


@dataclass(frozen=True, slots=True)
class KeyStats:
    """What calibration measured of one layer's keys, per KV head and channel ``[kv_heads,
    head_dim]``: the keys' mean and standard deviation and the root mean square of the queries
    that read them (ones where the queries were not seen)."""

    mean: np.ndarray
    std: np.ndarray
    query_rms: np.ndarray


def _three_bits(r: np.ndarray) -> np.ndarray:
    """``r > 0`` rounded to 3 significant bits."""
    e = np.floor(np.log2(r))
    f = np.round(r / 2.0 ** e * 4) / 4  # in [1, 2]
    return (f * 2.0 ** e).astype(np.float32)


@dataclass(frozen=True, eq=False)
class KeyShape:
    """One page group's key offsets and weights: ``offsets`` and ``scales`` ``[layers,
    kv_heads, 1, head_dim]`` (float32 holding float16 offsets and 3-bit weights), a row per
    model slot in ``slots``. Equal when their digests are."""

    slots: tuple[int, ...]
    offsets: mx.array
    scales: mx.array
    digest: str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyShape) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    @classmethod
    def from_stats(cls, slots: Sequence[int], stats: Mapping[int, KeyStats]) -> "KeyShape":
        """The shape of the keys of model slots ``slots`` from their calibration."""
        offs, scales = [], []
        for s in slots:
            st = stats[s]
            m = np.nan_to_num(st.mean.astype(np.float32), nan=0.0, posinf=0.0, neginf=0.0)
            m = np.clip(m, -60000, 60000).astype(np.float16).astype(np.float32)
            r = np.sqrt(np.maximum(st.std, 0) / np.maximum(st.query_rms, 1e-6))
            r = np.where(np.isfinite(r), r, 0.0)
            top = r.max(axis=-1, keepdims=True)
            r = np.where(top > 0, r / np.where(top > 0, top, 1.0), 1.0)
            scales.append(_three_bits(np.maximum(r, 2.0 ** -8)))
            offs.append(m)
        o, d = np.stack(offs)[:, :, None, :], np.stack(scales)[:, :, None, :]
        h = hashlib.sha256(SHAPE.encode())
        h.update(np.asarray(slots, np.int64).tobytes())
        h.update(np.ascontiguousarray(o).tobytes())
        h.update(np.ascontiguousarray(d).tobytes())
        shape = cls(tuple(slots), mx.array(o), mx.array(d), h.hexdigest()[:32])
        # NOTE: evaluated now (the arrays are shared by threads: see ``quant._Codec``).
        mx.eval(shape.offsets, shape.scales)
        return shape

    def layer(self, slot: int | None) -> tuple[mx.array, mx.array]:
        """``(offsets, scales)`` of one model slot ``[kv_heads, 1, head_dim]``, or of every
        layer of the group for ``None``."""
        if slot is None:
            return self.offsets, self.scales
        i = self.slots.index(slot)
        return self.offsets[i], self.scales[i]

    def describe(self) -> dict:
        return {"kv_key_shape": f"{SHAPE}:{self.digest}"}


def shapes_for(groups: Sequence[Sequence[int]], stats: Mapping[int, KeyStats] | None
               ) -> list["KeyShape | None"]:
    """A ``KeyShape`` per group of slots (None where calibration saw none of its layers)."""
    if not stats:
        return [None] * len(groups)
    return [KeyShape.from_stats(g, stats) if all(s in stats for s in g) else None
            for g in groups]

