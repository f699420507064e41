"""Runs: consecutive sealed pages whose storage is one array (pages restored from disk together).

A restore reads a run of page files straight into one array ``[group layers, 2, kv_heads,
pages * page_size, head_dim]``; each page's data is a slice of it (made when asked for: a
restore of many small pages does not pay for slices nobody reads), and a prefix view over
exactly those pages uses the array itself (no second copy of the run). The array lives while
any page of the run does, so the page pool keeps a freed page's bytes counted (and its block id
taken) until the last page of its run goes: what the pool counts is what it holds.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx


class Run:
    __slots__ = ("array", "blocks", "live", "pending")

    def __init__(self, array: mx.array, blocks: Sequence[int]):
        self.array = array
        self.blocks = tuple(blocks)
        self.live = set(blocks)
        self.pending: list[int] = []  # freed pages whose bytes the array still holds


class PageRuns:
    """Which pages share a run array, and the slices each page reads of it (held by the
    pool's storage, ``PageStorage.runs``: the pool decides when a page is added or freed)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._of: dict[int, tuple[Run, int]] = {}  # block -> its run, its index in the run

    def add(self, array: mx.array, blocks: Sequence[int]) -> None:
        run = Run(array, blocks)
        self._of.update((b, (run, i)) for i, b in enumerate(blocks))

    def page(self, block: int) -> mx.array | None:
        """The page's data (its slice of the run array), or None when it is in no run."""
        found = self._of.get(block)
        if found is None:
            return None
        run, i = found
        P = self.page_size
        return run.array[:, :, :, i * P : (i + 1) * P, :]

    def whole(self, blocks: Sequence[int], num_tokens: int) -> mx.array | None:
        """The run array when ``blocks`` are exactly one run's pages, in order, all live, and
        ``num_tokens`` fills them; else None."""
        found = self._of.get(blocks[0]) if blocks else None
        run = found[0] if found is not None else None
        if run is None or tuple(blocks) != run.blocks or len(run.live) != len(blocks) \
                or num_tokens != len(blocks) * self.page_size:
            return None
        return run.array

    def free(self, block: int) -> list[int]:
        """The blocks whose storage goes now that ``block`` is freed: itself when in no run,
        none while other pages of its run live (it waits), or its run's all when it was the
        last."""
        found = self._of.pop(block, None)
        if found is None:
            return [block]
        run = found[0]
        run.live.discard(block)
        run.pending.append(block)
        if run.live:
            return []
        return run.pending
