"""Where the pool's page data lives, and reads of it as contiguous arrays.

A page written position by position has its own array ``[group layers, 2, kv_heads, n,
head_dim]`` (``n`` grows to ``page_size`` while it is open); a page restored with others from
disk is a slice of their run's one array (``kv_cache.pages.runs``). The ``PagePool`` decides
what a page is and who holds it; this part only keeps and reads its bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import mlx.core as mx

from kv_cache.errors import InvalidBlockError
from kv_cache.pages.runs import PageRuns

if TYPE_CHECKING:
    from kv_cache.layout.spec import GroupSpec


class PageStorage:
    """Each page's data: its own array, or its slice of a run."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.arrays: dict[int, mx.array] = {}  # pages with their own array
        self.runs = PageRuns(page_size)  # pages restored together into one array

    def page(self, block: int) -> mx.array:
        """The page's data, ``[group layers, 2, kv_heads, n, head_dim]``. Read only."""
        d = self.arrays.get(block)
        if d is None:
            d = self.runs.page(block)
            if d is None:
                raise InvalidBlockError(f"block {block!r} has no data")
        return d

    def append(self, block: int, kv: mx.array) -> None:
        """Append positions to an open page's own array (a first write makes it)."""
        old = self.arrays.get(block)
        self.arrays[block] = kv if old is None else mx.concatenate([old, kv], axis=3)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Page ``dst``'s own array: a copy of the first ``n`` positions of ``src``."""
        self.arrays[dst] = mx.contiguous(self.page(src)[:, :, :, :n, :])

    def add_run(self, array: mx.array, blocks: Sequence[int]) -> None:
        """``blocks`` are consecutive slices of ``array`` (``kv_cache.pages.runs``)."""
        self.runs.add(array, blocks)

    def free(self, block: int) -> list[int]:
        """Drop ``block``'s data; the blocks whose storage went with it (a run's go with its
        last page, until then none)."""
        self.arrays.pop(block, None)
        return self.runs.free(block)

    def run_array(self, blocks: Sequence[int], num_tokens: int) -> mx.array | None:
        """The one array holding exactly ``blocks`` (a run restored together), when
        ``num_tokens`` fills them; else None."""
        return self.runs.whole(blocks, num_tokens)

    def _pieces(self, blocks: Sequence[int], num_tokens: int) -> list[mx.array]:
        P = self.page_size
        if not (len(blocks) - 1) * P < num_tokens <= len(blocks) * P:
            raise ValueError(f"{num_tokens} tokens do not match {len(blocks)} pages")
        pieces = []
        for i, b in enumerate(blocks):
            n, d = min(P, num_tokens - i * P), self.page(b)
            if d.shape[3] < n:
                raise ValueError(f"block {b} holds {d.shape[3]} tokens, {n} needed")
            pieces.append(d if d.shape[3] == n else d[:, :, :, :n, :])
        return pieces

    def gather(self, blocks: Sequence[int], num_tokens: int) -> mx.array:
        """The first ``num_tokens`` positions held by ``blocks``, as one array
        ``[layers, 2, kv_heads, num_tokens, head_dim]``."""
        pieces = self._pieces(blocks, num_tokens)
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=3)

    def gather_layers(self, blocks: Sequence[int], num_tokens: int, room: int,
                      group: GroupSpec | None) -> list[tuple[mx.array, mx.array]]:
        """Per layer, keys and values ``[1, kv_heads, num_tokens + room, head_dim]`` holding the
        first ``num_tokens`` positions, then ``room`` zero positions to write into: one copy of
        the data, straight into each layer's own buffer. Without room, the copy is one array
        for all layers and each layer's keys and values are contiguous slices of it (one
        operation however many pages and layers: a prefix view's read-only data). ``group``:
        the pages' group (its shape pads the room, its codec decodes pages in bits)."""
        pieces = self._pieces(blocks, num_tokens)
        if group is not None and group.quant is not None:  # one decode of all the pages
            pieces = [group.decode(mx.concatenate(pieces, axis=3))]
        if not room:
            every = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=3)
            return [(every[layer, 0][None], every[layer, 1][None])
                    for layer in range(every.shape[0])]
        pad = [mx.zeros((group.num_kv_heads, room, group.head_dim), group.mx_dtype)]
        out = []
        for layer in range(len(group.layers)):
            k = mx.concatenate([p[layer, 0] for p in pieces] + pad, axis=1)
            v = mx.concatenate([p[layer, 1] for p in pieces] + pad, axis=1)
            out.append((k[None], v[None]))
        return out
