"""Exceptions raised by the cache library.

Out-of-capacity is a specific exception the caller can recover from; misuse is a ``ValueError``
subclass; a broken invariant is an ``AssertionError`` with a message.
"""


class KVCacheError(Exception):
    """Base class of the library's errors."""


class OutOfBlocksError(KVCacheError):
    """The allocator (or the pool's byte budget) has no room for the blocks asked for.

    ``pages`` and ``group``: what the page pool was asked for, where it was the pool, so the
    caller can make that much room (``CacheManager.make_room``) and try again."""

    def __init__(self, message: str, pages: int | None = None, group: int = 0):
        super().__init__(message)
        self.pages, self.group = pages, group


class InvalidBlockError(KVCacheError, ValueError):
    """A block id outside the allocator's range, or one that is not allocated."""


class DoubleFreeError(InvalidBlockError):
    """A block id freed while already free."""


class FormatError(ValueError):
    """Not a valid file of ours: truncated, corrupt, hostile or not a regular file."""


class ForeignError(FormatError):
    """A valid file for another model, dtype, geometry or format version: never used."""
