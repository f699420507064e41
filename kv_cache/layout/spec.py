"""Cache specs: the one place where the shape of a model's cache is defined (read off a model by
``kv_cache.model.spec_reader``).

A model's cache is a list of slots, one per layer that keeps a cache (what mlx-lm's
``make_prompt_cache`` returns). Each slot is one of:

- full attention (mlx-lm ``KVCache``): keys and values for every position, paged;
- sliding window (``RotatingKVCache(max_size=W, keep=0)``): keys and values of the last ``W``
  positions are all a query reads, so pages wholly outside the window are released;
- recurrent state (``ArraysCache``: conv and SSM / gated-delta states): a few fixed-size arrays
  that summarise everything so far; not paged, snapshotted where a chat may resume.

Kinds of layer, and every rule that depends on them, are ``kv_cache.layout.kinds``. Paged slots
with the same kind (a window's size included), head count, head size and dtype form a *group*;
a page of a group holds ``page_size`` positions of every layer in it, stored as one array
``[layers, 2, kv_heads, n, head_dim]``. Groups have their own pages, hash chains and block tables
(vLLM's ``KVCacheSpec`` / ``KVCacheGroupSpec`` are the model for this split).

This floor is below the pages: a page's geometry (its group's shape and dtype, and with
``--kv-bits`` its codec, ``kv_cache.layout.quant``) is what the pool needs to hold it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import mlx.core as mx

from kv_cache.layout.kinds import FULL, STATE, PagedKind, RecurrentState, paged_kind
from kv_cache.layout.quant import KVQuant, group_size_for, make_quant, parse_bits

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


class UnsupportedCacheError(ValueError):
    """The model keeps a cache this library cannot page or snapshot (raised at load time)."""


def dtype_name(dtype: mx.Dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise UnsupportedCacheError(f"KV caches are kept in float16, bfloat16 or float32, not {dtype}")


def dtype_of(name: str) -> mx.Dtype:
    return _DTYPES[name]


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Paged layers that share a page layout: ``[len(layers), 2, kv_heads, n, head_dim]``."""

    kind: PagedKind  # FULL or SlidingWindow(window)
    layers: tuple[int, ...]  # cache slots of the model, in order
    num_kv_heads: int
    head_dim: int
    dtype: str
    quant: KVQuant | None = None  # pages held in 8 or 4 bits (``--kv-bits``), else in ``dtype``

    @property
    def window(self) -> int:
        """A sliding window's size (0: full attention)."""
        return self.kind.window

    @property
    def mx_dtype(self) -> mx.Dtype:
        return dtype_of(self.dtype)

    def shape(self, n: int) -> tuple[int, int, int, int, int]:
        return (len(self.layers), 2, self.num_kv_heads, n, self.head_dim)

    def page_bytes(self, page_size: int) -> int:
        return len(self.layers) * 2 * self.num_kv_heads * page_size * self.head_dim \
            * self.mx_dtype.size if self.quant is None else self.quant.page_bytes(
                len(self.layers), self.num_kv_heads, self.head_dim, page_size, self.mx_dtype)

    # A page as stored (in memory, on disk, in a store, in an export): the values, or with
    # ``quant`` one ``uint32`` array of codes, scales and biases (``KVQuant.encode``).

    def stored_shape(self, n: int) -> tuple[int, int, int, int, int]:
        if self.quant is None:
            return self.shape(n)
        return (*self.shape(n)[:4], self.quant.words(self.head_dim, self.mx_dtype))

    @property
    def stored_dtype(self) -> str:
        return self.dtype if self.quant is None else "uint32"

    def encode(self, kv: mx.array) -> mx.array:
        """Values ``shape(n)`` as stored."""
        kv = kv.astype(self.mx_dtype)
        return kv if self.quant is None else self.quant.encode(kv)

    def decode(self, page: mx.array) -> mx.array:
        """A stored page's values (exact: see ``kv_cache.layout.quant``)."""
        return page if self.quant is None else self.quant.decode(page, self.mx_dtype,
                                                                 self.head_dim)


@dataclass(frozen=True, slots=True)
class StateSpec:
    """A recurrent-state slot: ``shapes[i]`` / ``dtypes[i]`` of its arrays (batch of one)."""

    layer: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    kind: ClassVar[RecurrentState] = STATE

    @property
    def nbytes(self) -> int:
        total = 0
        for shape, dt in zip(self.shapes, self.dtypes):
            n = 1
            for d in shape:
                n *= d
            total += n * getattr(mx, dt).size
        return total


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Every cache slot of a model: paged groups and recurrent-state slots."""

    num_slots: int
    groups: tuple[GroupSpec, ...]
    states: tuple[StateSpec, ...] = ()

    @classmethod
    def plain(cls, num_layers: int, num_kv_heads: int, head_dim: int,
              dtype: mx.Dtype = mx.float16) -> "CacheSpec":
        """A model whose every layer is full attention of one shape."""
        if min(num_layers, num_kv_heads, head_dim) <= 0:
            raise ValueError("layers, heads and head_dim must all be > 0")
        g = GroupSpec(FULL, tuple(range(num_layers)), num_kv_heads, head_dim, dtype_name(dtype))
        return cls(num_layers, (g,))

    def with_quant(self, quant: KVQuant | None) -> "CacheSpec":
        """The same cache with its pages held by ``quant`` (None: in the model's dtype); part
        of the description, so of the fingerprint: pages of two settings never mix. Keys per
        channel over a page (``quant.key_block``) are for full-attention groups (a sliding
        window's keep per-position scales) of a model without recurrent state (which resumes
        where an entry ends, not at a page boundary)."""
        for g in self.groups:
            if quant is not None:
                quant.check(g.head_dim)
        if quant is not None and quant.key_block and self.has_state:
            raise ValueError("keys per channel over a page need a model without recurrent "
                             "state (key_block_for gives such a model per-position keys)")

        def group_quant(g: GroupSpec) -> KVQuant | None:
            if quant is None or not quant.key_block or g.kind.reads_all:
                return quant
            return replace(quant, key_block=0)
        return replace(self, groups=tuple(replace(g, quant=group_quant(g)) for g in self.groups))

    @property
    def whole_pages(self) -> bool:
        """Whether a reuse starts at a page boundary: keys per channel over a page have no codes
        until the page is full, and a stored open page holds none (``channel_keys``)."""
        return any(g.quant is not None and g.quant.key_block for g in self.groups)

    @property
    def has_state(self) -> bool:
        return bool(self.states)

    @property
    def has_window(self) -> bool:
        return any(not g.kind.reads_all for g in self.groups)

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (for fingerprints and file headers)."""
        return {
            "num_slots": self.num_slots,
            "groups": [{"kind": g.kind.name, "layers": list(g.layers),
                        "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim, "dtype": g.dtype,
                        "window": g.window, **(g.quant.describe() if g.quant else {})}
                       for g in self.groups],
            "states": [{"layer": s.layer, "shapes": [list(x) for x in s.shapes],
                        "dtypes": list(s.dtypes)} for s in self.states],
        }

    def to_json(self) -> str:
        return json.dumps(self.describe(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "CacheSpec":
        d = json.loads(text)
        groups = tuple(GroupSpec(paged_kind(g["kind"], int(g["window"])), tuple(g["layers"]),
                                 int(g["num_kv_heads"]), int(g["head_dim"]), g["dtype"],
                                 KVQuant.from_description(g) if "kv_bits" in g else None)
                       for g in d["groups"])
        states = tuple(StateSpec(int(s["layer"]), tuple(tuple(x) for x in s["shapes"]),
                                 tuple(s["dtypes"])) for s in d["states"])
        return cls(int(d["num_slots"]), groups, states)


def with_kv_bits(spec: CacheSpec, fingerprint: str, bits: int | str | tuple | None,
                 key_block: int = 0) -> tuple[CacheSpec, str]:
    """A model's cache spec and fingerprint with its pages in ``bits`` (unchanged without):
    ``8``, ``4``, or keys' and values' own as ``(8, 4)`` or ``"8,4"``; each group rotated first,
    in groups of 64 along ``head_dim`` (32 where 64 does not divide it: ``group_size_for``);
    ``key_block``: keys per channel over pages of that many positions
    (``kv_cache.layout.channel_keys``; the server's choice: ``key_block_for``).

    NOTE: the setting enters the fingerprint, so pages of two settings never mix: their chain
    hashes, disk directory, store keys and exports all differ, and each is a clean miss (not a
    foreign file, removed) for the other."""
    if parse_bits(bits) is None:
        return spec, fingerprint
    quant = replace(make_quant(bits, group_size_for(g.head_dim for g in spec.groups)),
                    key_block=key_block)
    held = spec.with_quant(quant)
    blob = json.dumps([fingerprint, quant.describe()], sort_keys=True).encode()
    return held, hashlib.sha256(blob).hexdigest()


def key_block_for(spec: CacheSpec, bits: int | str | tuple | None, page_size: int) -> int:
    """The page size over which keys of pages in ``bits`` get per-channel scales, and a page's
    keys and values are coded when the page is full (``kv_cache.model.channel_cache``): every
    model without recurrent state (which resumes where an entry ends, not at a page boundary);
    0 (keys per position along ``head_dim``, coded as they come) for one with it, and without
    ``bits``. Measured on the default model with benchmarks/kv_quality.py, perplexity over a
    long text: 4 bits +1.74% per channel against +8.25% per position, 8,4 +0.22% against
    +1.27%, 8 -0.003% against -0.03% (per channel: its latest run, docs/BENCHMARKS.md, "KV
    pages in 8 and 4 bits"; per position: an earlier run, in docs/BENCHMARKS.md's git history)."""
    if parse_bits(bits) is None or spec.has_state:
        return 0
    return page_size
