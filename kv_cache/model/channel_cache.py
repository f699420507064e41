"""A full-attention layer whose pages hold keys per channel over a page
(``kv_cache.layout.channel_keys``): what its queries read, and what its commits write.

A page's keys are coded when the page is full, from their float values, once. Until then they
are read as float. So a query at position ``p`` reads the keys of the pages before its own page
as their codes give them back, and the keys of its own page, up to ``p``, as float: a rule of
positions alone, so a text read in any pieces (a prompt in chunks, a decode step, a verify pass)
reads what token-by-token decoding reads, and greedy output with the cache equals output without
it under the same setting.

The working buffer holds the decoded keys of the pages sealed so far (``sealed``: the first
position still float) and the float keys after. A pass that begins on a page is read with keys
``[buffer; decoded copies of the pages completed inside the pass]`` and a mask that gives each
query its own view (``make_mask`` for the model's own attention, ``Reads.block`` for the split
path of ``kv_cache.model.attention``): a key of the query's own page as float, a key of an
earlier page as decoded. The next pass (or a commit) seals those pages in the buffer.

Commits write a page's key codes once the page is full (the page is written again whole then,
``kv_cache.model.page_writes``); the rows of a page still open carry its values' words and no
key codes. The float keys of the open page are therefore only here: the layer keeps them when
its buffer is dropped (``tail``), and a cache reused from pages starts at a page boundary
(``CacheSpec.whole_pages``), so a stored open page is never read. A trim back into the last
sealed page restores its float keys (``orig``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from kv_cache.layout import channel_keys
from kv_cache.model.attention import Reads
from kv_cache.model.layer_cache import PagedLayerCache


class ChannelKeysCache(PagedLayerCache):
    """``PagedLayerCache`` for a group whose ``quant.key_block`` is set (its page size)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sealed = 0  # buffer positions before it hold decoded keys, from it float keys
        self.page_words: list[tuple[int, mx.array]] = []  # sealed pages' key words, by start
        self.orig: tuple[int, mx.array] | None = None  # the last sealed page's float keys
        self.tail: tuple[int, mx.array] | None = None  # the open page's float keys, no buffer
        self._span: tuple[int, int] = (0, 0)  # the last pass's decoded copies: pages [a, b)

    def _page(self, p: int) -> int:
        return p // self.page_size * self.page_size

    def _seal_to(self, end: int) -> None:
        """Code the full pages of positions ``sealed..end-1`` in the buffer (once each)."""
        start = max(self.sealed, self.base)
        if end <= start or self.keys is None:
            self.sealed = max(self.sealed, end)
            return
        a, b = start - self.base, end - self.base
        floats = self.keys[..., a:b, :]
        read, words = channel_keys.seal(floats, self.quant.bits, self.page_size)
        self.keys[..., a:b, :] = read
        self.page_words.append((start, words))
        self.orig = (end - self.page_size, floats[..., -self.page_size:, :])
        self.sealed = end

    def update_and_fetch(self, keys: mx.array, values: mx.array,
                         stored: tuple[mx.array, mx.array] | None = None
                         ) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            self._start_buffer()
        q_start = self.offset
        self._seal_to(self._page(q_start))
        self._append(keys, values, stored)
        n = self.offset - self.base
        k, v = self.keys[..., :n, :], self.values[..., :n, :]
        first, last = self._page(q_start), self._page(self.offset - 1)
        self._span = (first, last)
        if last > first:  # pages completed inside the pass, read decoded by the later queries
            a, b = first - self.base, last - self.base
            read, _ = channel_keys.seal(self.keys[..., a:b, :], self.quant.bits,
                                        self.page_size)
            k = mx.concatenate([k, read], axis=2)
            v = mx.concatenate([v, self.values[..., a:b, :]], axis=2)
        return self._fetched(k, v, self.base, q_start)

    def read(self) -> Reads:
        r = super().read()
        first, last = self._span
        r.block, r.float_from, r.copies = self.page_size, first, last - first
        if last > first:
            r.buffer = None  # the keys are not a slice of the buffer
        return r

    def make_mask(self, N: int, return_array: bool = False,
                  window_size: Optional[int] = None) -> mx.array | str | None:
        """The model's own attention (one sequence, no shared prefix): causal within a page;
        across pages a boolean mask over ``[buffer; decoded copies]`` (see the module)."""
        q0, P = self.offset, self.page_size
        first, last = self._page(q0), self._page(q0 + N - 1)
        if last == first or window_size is not None:
            return super().make_mask(N, return_array, window_size)
        end = q0 + N
        kpos = mx.concatenate([mx.arange(self.base, end), mx.arange(first, last)])
        is_float = mx.concatenate([mx.arange(self.base, end) >= first,
                                   mx.zeros((last - first,), mx.bool_)])
        qpos = mx.arange(q0, end)[:, None]
        same = (kpos[None] // P) == (qpos // P)
        return (kpos[None] <= qpos) & (is_float[None] == same)

    # -- commits --------------------------------------------------------------------------------

    def stored(self, start: int, end: int) -> mx.array:
        """Rows of positions ``start..end-1``: key codes where their page is full (zeros in an
        open page), the values' words as ``fresh`` made them."""
        self._seal_to(self._page(self.offset))
        parts, at = [], start
        for a, w in self.page_words:
            b = a + w.shape[2]
            if b <= at or a >= end:
                continue
            parts.append(w[0, :, at - a : min(b, end) - a])
            at = min(b, end)
        vw = self._value_words(start, end)
        if at < end:
            parts.append(mx.zeros((*vw.shape[:-2], end - at,
                                   self.quant.key_words(self.keys.shape[-1], self.keys.dtype)),
                                  mx.uint32))
        lo = self._page(start)  # a page completed later is written again from its start
        self.page_words = [(a, w) for a, w in self.page_words if a + w.shape[2] > lo]
        self._drop_words(lo)
        kw = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
        return self.quant.join(kw, vw)

    def _value_words(self, start: int, end: int) -> mx.array:
        parts, at = [], start
        for a, _, v in self.words:
            b = a + v.shape[2]
            if b <= at or a >= end:
                continue
            assert a <= at, f"positions {at}..{a} have no stored words (layer {self.layer})"
            parts.append(v[0, :, at - a : min(b, end) - a])
            at = min(b, end)
        assert at == end, f"positions {at}..{end} have no stored words (layer {self.layer})"
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)

    # -- buffers, views, trims ------------------------------------------------------------------

    def load(self, keys: mx.array, values: mx.array, base: int = 0,
             stored: mx.array | None = None) -> None:
        """Gathered pages (see ``PagedLayerCache.load``); ``stored``: the rows of the open page
        (its values' words) when the layer ends inside a page, whose float keys it kept."""
        super().load(keys, values, base)
        open_at = self._page(self.offset)
        self.sealed, self.page_words, self.orig = max(open_at, base), [], None
        if self.offset > open_at and open_at >= base:
            assert self.tail is not None and self.tail[0] == open_at, (
                f"layer {self.layer}: the float keys of positions {open_at}..{self.offset} "
                f"are not held (a reuse from pages starts at a page boundary)")
            a = open_at - base
            self.keys[..., a : a + self.tail[1].shape[2], :] = self.tail[1]
            kw, vw = self.quant.split(stored, keys.shape[-1], keys.dtype)
            self.words = [(open_at, kw[None], vw[None])]
        self.tail = None

    def float_tail(self) -> tuple[int, mx.array] | None:
        """The open page's float keys (a copy for a sequence that forks)."""
        if self.keys is None:
            return self.tail
        open_at = max(self._page(self.offset), self.base)
        if self.offset == open_at:
            return None
        self._seal_to(self._page(self.offset))
        a, b = open_at - self.base, self.offset - self.base
        return open_at, mx.contiguous(self.keys[..., a:b, :])

    def drop_buffer(self) -> None:
        self.tail = self.float_tail() if self.offset else None
        super().drop_buffer()
        self.page_words, self.orig, self.sealed = [], None, 0

    def use_view(self, view, length: int) -> None:
        super().use_view(view, length)
        self.sealed = max(self.sealed, length if self.keys is not None else 0)
        self.page_words = [(a, w) for a, w in self.page_words if a + w.shape[2] > length]

    def can_trim_to(self, length: int) -> bool:
        if not super().can_trim_to(length):
            return False
        at = self._page(length)
        return (length >= self.sealed or length == at or self.keys is None
                or (self.orig is not None and self.orig[0] == at and at + self.page_size
                    == self.sealed))

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self.keys is not None and self.offset < self.sealed:
            at = self._page(self.offset)
            if self.offset > at:  # back into a sealed page: its float keys again
                a = at - self.base
                self.keys[..., a : a + self.page_size, :] = self.orig[1]
            self.sealed = at
            self.page_words = [(a, w) for a, w in self.page_words if a < at]
            self.page_words = [(a, w[:, :, : at - a]) for a, w in self.page_words]
            self.orig = None
        return n

    @property
    def nbytes(self) -> int:
        extra = sum(w.nbytes for _, w in self.page_words)
        extra += sum(x[1].nbytes for x in (self.orig, self.tail) if x is not None)
        return super().nbytes + extra
