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

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.page_size

    def blocks_needed(self, n_tokens: int) -> int:
        """How many new blocks appending ``n_tokens`` tokens needs."""
        return max(0, -(-(self.num_tokens + n_tokens) // self.page_size) - len(self.blocks))

    def append_tokens(self, n_tokens: int, new_blocks: list[int] = ()) -> None:
        """Account for ``n_tokens`` more tokens, placing them in ``new_blocks`` as needed."""
        if n_tokens < 0:
            raise ValueError(f"cannot append {n_tokens} tokens")
        if len(new_blocks) != self.blocks_needed(n_tokens):
            raise ValueError(
                f"appending {n_tokens} tokens needs {self.blocks_needed(n_tokens)} new blocks, "
                f"got {len(new_blocks)}"
            )
        self.blocks.extend(new_blocks)
        self.num_tokens += n_tokens

    def block_for_token(self, pos: int) -> int:
        self._check_pos(pos)
        return self.blocks[pos // self.page_size]

    def offset_in_block(self, pos: int) -> int:
        self._check_pos(pos)
        return pos % self.page_size

    def tokens_in_block(self, index: int) -> int:
        """How many of this table's tokens the ``index``-th block holds."""
        return min(self.page_size, self.num_tokens - index * self.page_size)

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

    def copy(self) -> "PageTable":
        return PageTable(self.page_size, self.blocks, self.num_tokens)

    def _check_pos(self, pos: int) -> None:
        if not 0 <= pos < self.num_tokens:
            raise IndexError(f"token position {pos} outside 0..{self.num_tokens - 1}")
