"""Token-id sequences: the two operations a turn does on a whole chat's ids, in C loops.

A restored turn of a long chat compares and copies tens of thousands of ids; done one id at a
time in the interpreter that is a millisecond or more (measured: 16,000 ids, ~1 ms each).
"""

from __future__ import annotations

from array import array
from typing import Sequence

_CHUNK = 1024  # ids compared at once while looking for the first difference


def token_list(tokens: Sequence[int]) -> list[int]:
    """``tokens`` as a new list of Python ints (numpy integers taken, anything else refused)."""
    return array("q", tokens).tolist()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    lo = 0
    while lo < n:  # chunks compared as lists (C loops) until one differs
        hi = min(n, lo + _CHUNK)
        if list(a[lo:hi]) != list(b[lo:hi]):
            for i in range(lo, hi):
                if a[i] != b[i]:
                    return i
        lo = hi
    return n
