"""Cache specs: the one place where the shape of a model's cache is defined.

A model's cache is a list of slots, one per layer that keeps a cache (what mlx-lm's
``make_prompt_cache`` returns). Each slot is one of:

- full attention (mlx-lm ``KVCache``): keys and values for every position, paged;
- sliding window (``RotatingKVCache(max_size=W, keep=0)``): keys and values of the last ``W``
  positions are all a query reads, so pages wholly outside the window are released;
- recurrent state (``ArraysCache``: conv and SSM / gated-delta states): a few fixed-size arrays
  that summarise everything so far; not paged, snapshotted where a chat may resume.

Kinds of layer, and every rule that depends on them, are ``kv_cache.model.kinds``. Paged slots
with the same kind (a window's size included), head count, head size and dtype form a *group*;
a page of a group holds ``page_size`` positions of every layer in it, stored as one array
``[layers, 2, kv_heads, n, head_dim]``. Groups have their own pages, hash chains and block tables
(vLLM's ``KVCacheSpec`` / ``KVCacheGroupSpec`` are the model for this split).

Any other cache type (``CacheList``, quantized or chunked caches, a rotating cache that keeps a
prefix) is refused with an error naming the model type and the layer, when the model loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Sequence

import mlx.core as mx

from kv_cache.pages.quant import KVQuant
from kv_cache.model.kinds import FULL, STATE, PagedKind, RecurrentState, SlidingWindow, paged_kind

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
        """A stored page's values (exact: see ``kv_cache.pages.quant``)."""
        return page if self.quant is None else self.quant.decode(page, self.mx_dtype)


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
        """The same cache with its pages held by ``quant`` (None: in the model's dtype); part of
        the description, so of the fingerprint: pages of two settings never mix."""
        for g in self.groups:
            if quant is not None:
                quant.check(g.head_dim)
        return replace(self, groups=tuple(replace(g, quant=quant) for g in self.groups))

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
                                 KVQuant(int(g["kv_bits"]), int(g["kv_group_size"]))
                                 if "kv_bits" in g else None)
                       for g in d["groups"])
        states = tuple(StateSpec(int(s["layer"]), tuple(tuple(x) for x in s["shapes"]),
                                 tuple(s["dtypes"])) for s in d["states"])
        return cls(int(d["num_slots"]), groups, states)


_SUPPORTED = ("KVCache", "RotatingKVCache", "ArraysCache")


def check_cache_types(caches: Sequence[Any], model_type: str = "model") -> None:
    """``UnsupportedCacheError`` naming the model type and the first layer whose cache is not
    one this library pages or snapshots (checked before any forward pass)."""
    for i, c in enumerate(caches):
        name = type(c).__name__
        if name not in _SUPPORTED or type(c).__module__ != "mlx_lm.models.cache":
            raise UnsupportedCacheError(
                f"{model_type}: layer {i} keeps a {name}, which this server cannot page or "
                "snapshot (supported: KVCache, RotatingKVCache without keep, ArraysCache)")
        if name == "RotatingKVCache" and c.keep:
            raise UnsupportedCacheError(
                f"{model_type}: layer {i} is a sliding-window cache that keeps its first "
                f"{c.keep} positions; not supported")


def spec_from_caches(caches: Sequence[Any], model_type: str = "model") -> CacheSpec:
    """The spec of ``caches``, mlx-lm cache objects after a one-token forward pass."""
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    check_cache_types(caches, model_type)
    paged: dict[tuple, list[int]] = {}
    states: list[StateSpec] = []
    for i, c in enumerate(caches):
        kind = type(c)
        if kind is KVCache or kind is RotatingKVCache:
            if c.keys is None:
                raise UnsupportedCacheError(f"{model_type}: layer {i} stored no keys in a forward "
                                            "pass")
            k, v = c.keys, c.values
            if k.shape[1] != v.shape[1] or k.shape[3] != v.shape[3]:
                raise UnsupportedCacheError(
                    f"{model_type}: layer {i} has keys {tuple(k.shape)} and values "
                    f"{tuple(v.shape)} of different shapes; not supported")
            window = c.max_size if kind is RotatingKVCache else 0
            key = (SlidingWindow(window) if window else FULL, int(k.shape[1]), int(k.shape[3]),
                   dtype_name(k.dtype))
            paged.setdefault(key, []).append(i)
        elif kind is ArraysCache:
            arrays = list(c.cache)
            if any(a is None for a in arrays):
                raise UnsupportedCacheError(f"{model_type}: layer {i} left part of its recurrent "
                                            "state empty after a forward pass")
            states.append(StateSpec(i, tuple(tuple(int(d) for d in a.shape) for a in arrays),
                                    tuple(str(a.dtype).split(".")[-1] for a in arrays)))
    groups = tuple(GroupSpec(kind, tuple(layers), heads, dim, dt)
                   for (kind, heads, dim, dt), layers in
                   sorted(paged.items(), key=lambda kv: kv[1][0]))
    return CacheSpec(len(caches), groups, tuple(states))


def spec_of_model(model: Any, model_type: str | None = None) -> CacheSpec:
    """Read a model's cache spec off its own cache after a one-token forward pass."""
    from mlx_lm.models.cache import make_prompt_cache

    model_type = str(model_type or getattr(getattr(model, "args", None), "model_type", None)
                     or type(model).__module__.rsplit(".", 1)[-1])
    caches = make_prompt_cache(model)
    check_cache_types(caches, model_type)
    model(mx.array([[0]]), cache=caches)
    mx.eval([getattr(c, "keys", None) for c in caches if getattr(c, "keys", None) is not None])
    return spec_from_caches(caches, model_type)
