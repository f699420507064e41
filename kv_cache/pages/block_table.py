"""A sequence's page table: which block holds which token positions. Block ids only."""

from __future__ import annotations


class PageTable:
    """Maps token positions ``0..num_tokens-1`` to ``(block, offset)`` with fixed-size pages.

    The table does not hold references itself: the owner of the table takes and drops them in the
    page pool when it adds or removes blocks.
    """

    __slots__ = ("page_size", "blocks", "num_tokens")

    def __init__(self, page_size: int, blocks: list[int] | None = None, num_tokens: int = 0):
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        self.blocks: list[int] = list(blocks or [])
        if not 0 <= num_tokens <= len(self.blocks) * page_size:
            raise ValueError(f"{num_tokens} tokens do not fit in {len(self.blocks)} blocks")
        if self.blocks and num_tokens <= (len(self.blocks) - 1) * page_size:
            raise ValueError("the last block of a page table must hold at least one token")
        self.num_tokens = num_tokens

    def blocks_needed(self, n_tokens: int) -> int:
        """How many new blocks appending ``n_tokens`` tokens needs."""
        return max(0, -(-(self.num_tokens + n_tokens) // self.page_size) - len(self.blocks))

    def truncate(self, num_tokens: int) -> list[int]:
        """Keep the first ``num_tokens`` tokens; returns the blocks no longer used."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate {self.num_tokens} tokens to {num_tokens}")
        keep = -(-num_tokens // self.page_size)
        dropped = self.blocks[keep:]
        del self.blocks[keep:]
        self.num_tokens = num_tokens
        return dropped

    def free_all(self) -> list[int]:
        """Empty the table; returns the blocks it had."""
        return self.truncate(0)
