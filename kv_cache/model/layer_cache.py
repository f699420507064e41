"""Per-layer cache objects that speak mlx-lm's cache protocol: buffers a sequence prepares.

While a sequence runs, each full-attention layer keeps its keys and values in a contiguous
working buffer that grows in steps, exactly as mlx-lm's ``KVCache`` does, so attention runs at
full speed on any mlx-lm model unchanged. A sliding-window layer keeps only what its window can
still read (a buffer of O(window) positions, dropped from the front as it slides). The pages in
the pool are the record: ``PagedSequence.commit`` copies new positions into them, and a sequence
that starts from stored pages gathers its buffers from them before its first forward pass
(``PagedSequence.prepare``). A full-attention layer that reads a shared prefix view
(``kv_cache.model.attention``) keeps only the positions after the view: its buffer starts at
``base`` = the view's length. Recurrent-state layers use mlx-lm's own ``ArraysCache`` (their state
is snapshotted by the sequence, not paged).

A layer cache knows nothing of its sequence: the sequence gives it what it reads (its buffers,
its view) between forward passes, and follows what mlx-lm's protocol does to it (``trim``) at
its own next step.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from kv_cache.model.attention import fetched
from kv_cache.model.reads import Reads
from kv_cache.layout.kinds import FullAttention, PagedKind, SlidingWindow
from kv_cache.layout.quant import KVQuant
from kv_cache.layout.spec import GroupSpec


class PagedLayerCache:
    """mlx-lm cache protocol: ``update_and_fetch``, ``offset``, ``state``, ``meta_state``,
    ``trim``, ``is_trimmable``, ``make_mask``, ``size``, ``empty``, ``nbytes``."""

    step = 256

    def __init__(self, kind: PagedKind, layer: int, page_size: int, offset: int = 0,
                 quant: KVQuant | None = None):
        self.kind, self.window, self.page_size = kind, kind.window, page_size
        self.quant = quant  # pages in bits: new keys and values are read as pages hold them
        # With ``quant``: the stored words of the positions appended since the buffer was made
        # (chunks ``(first position, key words, value words)``, ``[1, heads, n, words]``), what
        # a commit writes to pages: the codes are the truth, never re-quantized from values.
        self.words: list[tuple[int, mx.array, mx.array]] = []
        self.layer = layer  # the model's cache slot
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = offset
        self.base = 0  # the position held at index 0 of the buffer
        self.view: Any = None  # the shared prefix view read before the buffer (full attention)
        self.view_len = 0  # how many positions of it

    def update_and_fetch(self, keys: mx.array, values: mx.array,
                         stored: tuple[mx.array, mx.array] | None = None
                         ) -> tuple[mx.array, mx.array]:
        """``stored``: with pages in bits, the words of ``keys`` and ``values``, which are then
        already what the model reads of them (``KVQuant.fresh``: a batch codes all its members
        in one call)."""
        if self.keys is None:
            self._start_buffer()
        q_start = self.offset
        self._append(keys, values, stored)
        n = self.offset - self.base
        return self._fetched(self.keys[..., :n, :], self.values[..., :n, :], self.base, q_start)

    def _start_buffer(self) -> None:
        self.base = self.keep_from(self.offset)
        assert self.offset == self.base, (
            f"a layer holding {self.offset} positions was not prepared (PagedSequence.prepare)")

    def _fetched(self, keys: mx.array, values: mx.array, own_start: int,
                 q_start: int) -> tuple[mx.array, mx.array]:
        self._read = (keys, values, own_start, q_start, own_start - self.base)
        fetched(keys, self)
        return keys, values

    def read(self) -> Reads:
        """What the last ``update_and_fetch``'s queries read (for ``attention``)."""
        keys, values, own_start, q_start, at = self._read
        view = self.view
        prefix = view.prefix(self.layer, self.base) if view is not None else None
        return Reads(prefix, view, keys, values, own_start, q_start, self.window,
                     (self.keys, self.values), at)

    def reads(self) -> list[Reads] | None:
        """None when the model's own attention over the returned keys is right (no shared
        prefix before them)."""
        if self.view is None:
            return None
        return [self.read()]

    def use_view(self, view: Any, length: int) -> None:
        """Read the first ``length`` positions from ``view`` (None: from nothing): a buffer
        that holds them drops them (between forward passes only)."""
        if self.keys is not None and length > self.base:
            cut = length - self.base
            self.keys = mx.contiguous(self.keys[..., cut:, :])
            self.values = mx.contiguous(self.values[..., cut:, :])
            self.base = length
            self._drop_words(length)
        self.view, self.view_len = view, length

    def _append(self, keys: mx.array, values: mx.array,
                stored: tuple[mx.array, mx.array] | None = None) -> None:
        if self.quant is not None:
            # NOTE: the model reads the decoded values of exactly the words the page will hold
            # (the commit writes these words, it never quantizes values again), so a turn
            # restored from pages computes what the warm one did, and cache on equals cache off
            # under the same setting.
            if stored is None:
                keys, values, *stored = self.quant.fresh(keys, values)
            self._keep_words(*stored)
        prev = self.offset - self.base
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
        end = self.offset - self.base
        self.keys[..., prev:end, :] = keys
        self.values[..., prev:end, :] = values

    def load(self, keys: mx.array, values: mx.array, base: int = 0,
             stored: mx.array | None = None) -> None:
        """Start from gathered pages: ``[1, kv_heads, >= offset - base, head_dim]`` each holding
        positions ``base..offset-1`` (positions past ``offset`` are room to write into).
        ``stored``: with pages in bits, the pages' own rows of those positions ``[2, kv_heads,
        offset - base, words]``, for a layer that may have to write them again (a sliding
        window whose released page a trim brings back)."""
        self.keys, self.values, self.base = keys, values, base
        self.words = []
        if stored is not None:
            kw, vw = self.quant.split(stored, keys.shape[-1], keys.dtype)
            self.words = [(base, kw[None], vw[None])]

    # -- stored words (pages in bits) ----------------------------------------------------------

    def _keep_words(self, kw: mx.array, vw: mx.array) -> None:
        at, words = self.offset, self.words
        while words and words[-1][0] >= at:  # positions a trim dropped
            words.pop()
        if words and words[-1][0] + words[-1][1].shape[2] > at:
            a, k, v = words[-1]
            words[-1] = (a, k[:, :, : at - a], v[:, :, : at - a])
        words.append((at, kw, vw))
        if len(words) > 64:  # one chunk a decode step: keep the list short
            words[:-1] = [(words[0][0], mx.concatenate([w[1] for w in words[:-1]], axis=2),
                           mx.concatenate([w[2] for w in words[:-1]], axis=2))]

    def _drop_words(self, before: int) -> None:
        """Forget the words of chunks that end at or before position ``before``."""
        self.words = [w for w in self.words if w[0] + w[1].shape[2] > before]

    def stored(self, start: int, end: int) -> mx.array:
        """Positions ``start..end-1`` as their pages store them, ``[2, kv_heads, n, words]``
        (pages in bits: the words ``fresh`` made for them)."""
        parts, at = [], start
        for a, k, v in self.words:
            b = a + k.shape[2]
            if b <= at or a >= end:
                continue
            assert a <= at, f"positions {at}..{a} have no stored words (layer {self.layer})"
            parts.append((k[0, :, at - a : min(b, end) - a], v[0, :, at - a : min(b, end) - a]))
            at = min(b, end)
        assert at == end, f"positions {at}..{end} have no stored words (layer {self.layer})"
        if self.kind.reads_all:
            # NOTE: a full-attention layer's commits only go forward (a trim re-appends), so
            # what is before ``start`` is never written again.
            self._drop_words(start)
        k = parts[0][0] if len(parts) == 1 else mx.concatenate([p[0] for p in parts], axis=1)
        v = parts[0][1] if len(parts) == 1 else mx.concatenate([p[1] for p in parts], axis=1)
        return self.quant.join(k, v)

    def positions(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Keys and values ``[kv_heads, end - start, head_dim]`` of positions ``start..end-1``."""
        assert self.base <= start and self.keys is not None, (
            f"positions from {start} asked of a buffer that starts at {self.base}")
        a, b = start - self.base, end - self.base
        return self.keys[0, :, a:b, :], self.values[0, :, a:b, :]

    def drop_buffer(self) -> None:
        self.keys = self.values = None
        self.base = 0
        self.words = []

    def keep_from(self, length: int) -> int:
        """The first position a buffer of ``length`` positions must keep: all after the shared
        prefix view, if the layer reads one."""
        return self.view_len

    def can_trim_to(self, length: int) -> bool:
        return length >= self.view_len and (self.keys is None or length >= self.base)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None and self.offset == 0

    @property
    def state(self):
        if self.keys is None:
            return []
        n = self.offset - self.base
        return self.keys[..., :n, :], self.values[..., :n, :]

    @state.setter
    def state(self, v):
        if v:
            self.keys, self.values = v
            self.offset, self.base = self.keys.shape[2], 0

    @property
    def meta_state(self):
        return str(self.offset)

    @meta_state.setter
    def meta_state(self, v):
        self.offset = int(v)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions (mlx-lm's ``trim_prompt_cache`` trims layer by layer;
        the sequence drops their token ids and pages at its next step: ``PagedSequence.sync``)."""
        n = min(self.offset, n)
        self.offset -= n
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
        return self.keys.nbytes + self.values.nbytes \
            + sum(k.nbytes + v.nbytes for _, k, v in self.words)


class PagedWindowCache(PagedLayerCache):
    """A sliding-window layer (mlx-lm's ``RotatingKVCache(max_size=window)``): a query at
    position ``p`` reads keys ``p - window + 1 .. p``. The buffer keeps from the start of the
    page that holds the oldest position the next query reads, and drops the rest from its front
    as the window slides, so it stays O(window)."""

    def keep_from(self, length: int) -> int:
        """The first position a buffer of ``length`` positions must keep (page-aligned)."""
        return self.kind.keep_from(length, self.page_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array,
                         stored: tuple[mx.array, mx.array] | None = None
                         ) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            self._start_buffer()
        prev = self.offset
        self._slide(prev)
        self._append(keys, values, stored)
        first = self.kind.first_needed(prev)
        start, end = first - self.base, self.offset - self.base
        return self._fetched(self.keys[..., start:end, :], self.values[..., start:end, :],
                             first, prev)

    def _slide(self, length: int) -> None:
        drop = self.keep_from(length) - self.base
        # NOTE: dropped in steps of at least a window, so the copy is amortised over many tokens.
        if self.keys is not None and drop >= max(self.window, self.step):
            self.keys = mx.contiguous(self.keys[..., drop:, :])
            self.values = mx.contiguous(self.values[..., drop:, :])
            self.base += drop
            self._drop_words(self.base)

    def can_trim_to(self, length: int) -> bool:
        return self.keys is None or self.kind.first_needed(length) >= self.base

    def make_mask(
        self, N: int, return_array: bool = False, window_size: Optional[int] = None
    ) -> mx.array | str | None:
        window = window_size or self.window
        if N == 1:
            return None  # update_and_fetch returns exactly the window
        kept = min(self.offset, self.window - 1)  # earlier keys update_and_fetch returns
        if kept + N > window or return_array:
            return create_causal_mask(N, kept, window_size=window)
        return "causal"


_CACHES: dict[type, type[PagedLayerCache]] = {FullAttention: PagedLayerCache,
                                             SlidingWindow: PagedWindowCache}


def stored_rows(group: GroupSpec, layers: Sequence[PagedLayerCache], start: int,
                end: int) -> mx.array:
    """Positions ``start..end-1`` of a group's ``layers`` as its pages store them, ``[layers,
    2, kv_heads, n, ...]``: the values, or with pages in bits the words made when the positions
    were appended (never the values quantized again)."""
    if group.quant is not None:
        return mx.stack([layer.stored(start, end) for layer in layers])
    return group.encode(mx.stack([mx.stack(parts) for parts in zip(
        *(layer.positions(start, end) for layer in layers))], axis=1))


def layer_cache(kind: PagedKind, layer: int, page_size: int, offset: int = 0,
                quant: KVQuant | None = None) -> PagedLayerCache:
    """The layer cache of a paged group's ``kind`` for the model's cache slot ``layer``."""
    return _CACHES[type(kind)](kind, layer, page_size, offset, quant)
