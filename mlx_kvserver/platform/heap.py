"""Giving the C allocator's free memory back to the system: :func:`give_back`.

What the process frees through ``malloc`` (MLX's arrays on the CPU backend below glibc's mmap
threshold, Python's larger objects, numpy's arrays, the tokenizers' buffers) mostly stays in the
allocator's heaps, resident, as free chunks between chunks still held: glibc gives a heap back
only from its top. A server that ran 1,000 mixed requests of a tiny model held ~11 MiB more of
such free chunks than after 100 (``mallinfo2``'s ``fordblks``, 15 -> 26 MiB, read beside a run
of benchmarks/memory_growth.py, in docs/BENCHMARKS.md's git history): most of what its resident
memory grew by. Handing the free pages back when the engine has nothing to do keeps the
resident memory at what is held.

- glibc (Linux): ``malloc_trim(0)``, which releases the free pages inside every arena, not only
  a heap's top.
- macOS: ``malloc_zone_pressure_relief(NULL, 0)``, the same for every malloc zone.
- Elsewhere (musl, Windows): nothing.

Only the standard library: the platform knows nothing of the server.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Callable
from functools import lru_cache

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _release() -> Callable[[], object] | None:
    """The allocator's call that hands its free pages back, or None where there is none."""
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):  # TypeError: Windows, which loads no library by None
        return None
    if sys.platform == "darwin":
        fn = getattr(libc, "malloc_zone_pressure_relief", None)
        if fn is None:
            return None
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_size_t
        return lambda: fn(None, 0)
    fn = getattr(libc, "malloc_trim", None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0)


def available() -> bool:
    """Whether this process's allocator can hand its free pages back."""
    return _release() is not None


def give_back() -> bool:
    """Hand the allocator's free pages back to the system (a few ms for a few hundred MB of
    heap); False where the allocator has no way to."""
    release = _release()
    if release is None:
        return False
    release()
    return True
