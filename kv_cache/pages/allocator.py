"""Block ids: the allocator hands out integer ids of fixed-size pages; it owns no storage."""

from __future__ import annotations

from collections import deque

from kv_cache.errors import DoubleFreeError, InvalidBlockError, OutOfBlocksError


class BlockAllocator:
    """Hands out block ids ``0..num_blocks-1``.

    Fresh ids come in increasing order; freed ids are reused first-in first-out, so the id a test
    gets is exact and predictable.
    """

    __slots__ = ("num_blocks", "_free", "_allocated")

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._allocated = bytearray(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def alloc(self) -> int:
        """One block id; ``OutOfBlocksError`` when none is free."""
        if not self._free:
            raise OutOfBlocksError(f"all {self.num_blocks} blocks are in use")
        block = self._free.popleft()
        self._allocated[block] = 1
        return block

    def alloc_n(self, n: int) -> list[int]:
        """``n`` block ids, all or none."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        return [self.alloc() for _ in range(n)]

    def free(self, block: int) -> None:
        self._check_range(block)
        if not self._allocated[block]:
            raise DoubleFreeError(f"block {block} is already free")
        self._allocated[block] = 0
        self._free.append(block)

    def is_allocated(self, block: int) -> bool:
        self._check_range(block)
        return bool(self._allocated[block])

    def _check_range(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise InvalidBlockError(f"block id {block!r} is not in 0..{self.num_blocks - 1}")
