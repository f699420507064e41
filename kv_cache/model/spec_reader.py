"""A model's cache spec read off its own caches (``kv_cache.layout.spec`` describes it).

The server runs a one-token forward pass on the model's ``make_prompt_cache`` and reads each
slot: ``KVCache`` and ``RotatingKVCache`` become paged groups, ``ArraysCache`` recurrent-state
slots. Any other cache type (``CacheList``, quantized or chunked caches, a rotating cache that
keeps a prefix) is refused with an error naming the model type and the layer, when the model
loads.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from kv_cache.layout.kinds import FULL, SlidingWindow
from kv_cache.layout.spec import (CacheSpec, GroupSpec, StateSpec, UnsupportedCacheError,
                                  dtype_name)

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
