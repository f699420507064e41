"""Writing a sequence's new positions into its pages (``PagedSequence.commit``), one cache group
at a time, and releasing the pages a group no longer reads.

A group's kind (``kv_cache.layout.kinds``) says from which position its pages are kept: for a
sliding window, positions before the window at the end of the commit get no page at all, and a
page the window reads again after a trim is written again from the buffer.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from kv_cache.model.layer_cache import PagedLayerCache, stored_rows
from kv_cache.pages.block_table import PageTable
from kv_cache.pages.pool import PagePool


def write_group(pool: PagePool, g: int, table: PageTable, layers: Sequence[PagedLayerCache],
                tokens: Sequence[int], start: int, end: int) -> list[int]:
    """Write positions ``start..end-1`` of group ``g``'s ``layers`` (and their ``tokens``) into
    ``table``'s pages: the open tail page in place when ours alone (copied first otherwise), new
    pages after it. Returns the indices in ``table`` of the pages written (to seal the full
    ones)."""
    P = pool.page_size
    lo = pool.groups[g].kind.keep_from(end, P)
    if lo > start:
        # Positions before the window's start at ``end`` are never read again: no pages.
        release_before(pool, table.blocks, lo)
        table.blocks.extend([None] * (lo // P - len(table.blocks)))
        table.num_tokens = start = lo
    elif None in table.blocks[lo // P :]:
        # A page the window reads was released before a trim brought it back into the
        # window: write it again from the buffer (sealing finds the same page if cached).
        start = table.blocks.index(None, lo // P) * P
        for b in table.truncate(start):
            if b is not None:
                pool.release(b)
    quant = pool.groups[g].quant
    if quant is not None and quant.key_block and start % P and end - start >= P - start % P:
        # Keys per channel over a page: the open page is full now and gets its key codes
        # (``kv_cache.model.channel_cache``), so it is written again whole.
        start -= start % P
        for b in table.truncate(start):
            pool.release(b)
    kv = stored_rows(pool.groups[g], layers, start, end)  # as the pages hold it
    if start % P and not pool.is_writable(table.blocks[-1], start % P):
        # NOTE: copy-on-write: the tail page is shared, sealed or longer than our view.
        copy = pool.copy(table.blocks[-1], start % P)
        pool.release(table.blocks[-1])
        table.blocks[-1] = copy
    new_blocks = pool.allocate(table.blocks_needed(end - start), g)
    pos, written = start, []
    if start % P:  # the open tail page, ours alone now
        idx, at = len(table.blocks) - 1, start % P
        take = min(P - at, end - start)
        pool.write(table.blocks[idx], _page_slice(kv, 0, take), tokens[pos : pos + take])
        written.append(idx)
        pos += take
    first_new = len(table.blocks)
    table.blocks.extend(new_blocks)
    for j, block in enumerate(new_blocks):
        take = min(P, end - pos)
        pool.write(block, _page_slice(kv, pos - start, pos - start + take),
                   tokens[pos : pos + take])
        written.append(first_new + j)
        pos += take
    table.num_tokens = end
    return written


def release_before(pool: PagePool, blocks: list[int | None], position: int) -> None:
    """Release the pages of ``blocks`` that end at or before ``position`` (None where they
    were)."""
    for i in range(min(position // pool.page_size, len(blocks))):
        if blocks[i] is not None:
            pool.release(blocks[i])
            blocks[i] = None


def _page_slice(kv: mx.array, a: int, b: int) -> mx.array:
    return kv if (a == 0 and b == kv.shape[3]) else mx.contiguous(kv[:, :, :, a:b, :])
