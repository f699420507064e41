"""A per-layer cache object that speaks mlx-lm's cache protocol, backed by a paged sequence.

While a sequence runs, each layer keeps its keys and values in a contiguous working buffer that
grows in steps, exactly as mlx-lm's ``KVCache`` does, so attention runs at full speed on any
mlx-lm model unchanged. The pages in the pool are the record: ``PagedSequence.commit`` copies new
positions into them, and a sequence that starts from stored pages gathers its buffer from them
on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

if TYPE_CHECKING:
    from .sequence import PagedSequence


class PagedLayerCache:
    """mlx-lm cache protocol: ``update_and_fetch``, ``offset``, ``state``, ``meta_state``,
    ``trim``, ``is_trimmable``, ``make_mask``, ``size``, ``empty``, ``nbytes``."""

    step = 256

    def __init__(self, sequence: "PagedSequence", layer: int, offset: int = 0):
        self.sequence = sequence
        self.layer = layer
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None and self.offset > 0:
            self.sequence.materialize()
        prev = self.offset
        if self.keys is None or prev + keys.shape[2] > self.keys.shape[2]:
            B, n_kv_heads, _, k_dim = keys.shape
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            new_k = mx.zeros((B, n_kv_heads, n_steps * self.step, k_dim), keys.dtype)
            new_v = mx.zeros((B, n_kv_heads, n_steps * self.step, values.shape[3]), values.dtype)
            if self.keys is not None:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def load(self, keys: mx.array, values: mx.array) -> None:
        """Start from gathered pages: ``[1, kv_heads, >= offset, head_dim]`` each (positions
        past ``offset`` are room to write into)."""
        self.keys, self.values = keys, values

    def drop_buffer(self) -> None:
        self.keys = self.values = None

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None and self.offset == 0

    @property
    def state(self):
        if self.keys is None:
            return []
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @state.setter
    def state(self, v):
        if v:
            self.keys, self.values = v
            self.offset = self.keys.shape[2]

    @property
    def meta_state(self):
        return str(self.offset)

    @meta_state.setter
    def meta_state(self, v):
        self.offset = int(v)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions (the sequence drops their pages and tokens)."""
        n = min(self.offset, n)
        self.offset -= n
        # NOTE: mlx-lm's trim_prompt_cache trims layer by layer: once the last one is trimmed,
        # the sequence follows (token ids, pages), so its length and reports are never stale.
        if all(layer.offset == self.offset for layer in self.sequence.layers):
            self.sequence._sync_trim()
        return n

    def make_mask(
        self, N: int, return_array: bool = False, window_size: Optional[int] = None
    ) -> mx.array | str | None:
        if window_size is not None or (N > 1 and return_array):
            return create_causal_mask(N, self.offset, window_size=window_size)
        return None if N == 1 else "causal"

    @property
    def nbytes(self) -> int:
        """Bytes of the working buffer (the pages are counted by the pool)."""
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes
