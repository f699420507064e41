"""A full-attention layer whose pages are coded when full: keys per channel over the page
(``kv_cache.layout.channel_keys``), values per position (``kv_cache.layout.quant``). What its
queries read, and what its commits write.

A page's keys and values are coded once, when the page is full, from their float values. Until
then they are read as float. So a query at position ``p`` reads the keys and values of the
pages before its own page as their codes give them back, and those of its own page, up to
``p``, as float: a rule of positions alone, so a text read in any pieces (a prompt in chunks, a
decode step, a verify pass) reads what token-by-token decoding reads, and greedy output with the
cache equals output without it under the same setting.

The working buffers hold the decoded keys and values of the pages sealed so far (``sealed``:
the first position still float) and the floats after. A pass that begins on a page is read with
``[buffer; decoded copies of the pages completed inside the pass]`` and a mask that gives each
query its own view (``make_mask`` for the model's own attention, ``Reads.block`` for the split
path of ``kv_cache.model.attention``): its own page float, earlier pages decoded. The next pass
(or a commit) seals those pages in the buffers.

Commits write a page's codes once the page is full (the page is written again whole then,
``kv_cache.model.page_writes``); the rows of a page still open hold no codes (zeros). The floats
of the open page are therefore only here: the layer keeps them when its buffers are dropped
(``tail``), and a cache reused from pages starts at a page boundary (``CacheSpec.whole_pages``),
so a stored open page is never read. A trim back into the last sealed page restores its floats
(``orig``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from kv_cache.model.reads import Reads
from kv_cache.model.layer_cache import PagedLayerCache

Floats = tuple[int, mx.array, mx.array]  # first position, keys, values ([1, heads, n, dim])


class ChannelKeysCache(PagedLayerCache):
    """``PagedLayerCache`` for a group whose ``quant.key_block`` is set (its page size)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sealed = 0  # buffer positions before it hold decoded keys and values, from it floats
        self.page_words: list[tuple[int, mx.array, mx.array]] = []  # sealed pages' words
        self.orig: Floats | None = None  # the last sealed page's floats
        self.tail: Floats | None = None  # the open page's floats while there are no buffers
        self._span: tuple[int, int] = (0, 0)  # the last pass's decoded copies: pages [a, b)

    def _page(self, p: int) -> int:
        return p // self.page_size * self.page_size

    def _keep_words(self, kw: mx.array, vw: mx.array) -> None:
        pass  # nothing is coded before its page is full (``_seal_to``)

    def _seal_to(self, end: int) -> None:
        """Code the full pages of positions ``sealed..end-1`` in the buffers (once each)."""
        start = max(self.sealed, self.base)
        if end <= start or self.keys is None:
            self.sealed = max(self.sealed, end)
            return
        a, b = start - self.base, end - self.base
        fk, fv = self.keys[..., a:b, :], self.values[..., a:b, :]
        k, v, kw, vw = self.quant.seal(fk, fv)
        self.keys[..., a:b, :] = k
        self.values[..., a:b, :] = v
        self.page_words.append((start, kw, vw))
        P = self.page_size
        self.orig = (end - P, fk[..., -P:, :], fv[..., -P:, :])
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
            ck, cv, _, _ = self.quant.seal(self.keys[..., a:b, :], self.values[..., a:b, :])
            k, v = mx.concatenate([k, ck], axis=2), mx.concatenate([v, cv], axis=2)
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
        """Rows of positions ``start..end-1``: their page's codes where it is full, zeros in
        an open page."""
        self._seal_to(self._page(self.offset))
        parts, at = [], start
        for a, kw, vw in self.page_words:
            b = a + kw.shape[2]
            if b <= at or a >= end:
                continue
            parts.append(self.quant.join(kw[0, :, at - a : min(b, end) - a],
                                         vw[0, :, at - a : min(b, end) - a]))
            at = min(b, end)
        if at < end:
            dim, dt = self.keys.shape[-1], self.keys.dtype
            words = self.quant.words(dim, dt)
            parts.append(mx.zeros((2, self.keys.shape[1], end - at, words), mx.uint32))
        lo = self._page(start)  # a page completed later is written again from its start
        self.page_words = [w for w in self.page_words if w[0] + w[1].shape[2] > lo]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    # -- buffers, views, trims ------------------------------------------------------------------

    def load(self, keys: mx.array, values: mx.array, base: int = 0,
             stored: mx.array | None = None) -> None:
        """Gathered pages (see ``PagedLayerCache.load``); a layer that ends inside a page puts
        back the open page's floats it kept."""
        super().load(keys, values, base)
        open_at = self._page(self.offset)
        self.sealed, self.page_words, self.orig = max(open_at, base), [], None
        if self.offset > open_at and open_at >= base:
            assert self.tail is not None and self.tail[0] == open_at, (
                f"layer {self.layer}: the floats of positions {open_at}..{self.offset} are not "
                f"held (a reuse from pages starts at a page boundary)")
            self._put(self.tail)
        self.tail = None

    def _put(self, floats: Floats) -> None:
        at, k, v = floats
        a = at - self.base
        self.keys[..., a : a + k.shape[2], :] = k
        self.values[..., a : a + v.shape[2], :] = v

    def float_tail(self) -> Floats | None:
        """The open page's floats (a copy for a sequence that forks)."""
        if self.keys is None:
            return self.tail
        open_at = max(self._page(self.offset), self.base)
        if self.offset == open_at:
            return None
        a, b = open_at - self.base, self.offset - self.base
        return (open_at, mx.contiguous(self.keys[..., a:b, :]),
                mx.contiguous(self.values[..., a:b, :]))

    def drop_buffer(self) -> None:
        self.tail = self.float_tail() if self.offset else None
        super().drop_buffer()
        self.page_words, self.orig, self.sealed = [], None, 0

    def use_view(self, view, length: int) -> None:
        super().use_view(view, length)
        self.sealed = max(self.sealed, length if self.keys is not None else 0)
        self.page_words = [w for w in self.page_words if w[0] + w[1].shape[2] > length]

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
            if self.offset > at:  # back into a sealed page: its floats again
                self._put(self.orig)
            self.sealed = at
            self.page_words = [(a, kw[:, :, : at - a], vw[:, :, : at - a])
                               for a, kw, vw in self.page_words if a < at]
            self.orig = None
        return n

    @property
    def nbytes(self) -> int:
        extra = sum(kw.nbytes + vw.nbytes for _, kw, vw in self.page_words)
        extra += sum(x[1].nbytes + x[2].nbytes for x in (self.orig, self.tail) if x is not None)
        return super().nbytes + extra
