"""Page hashes: a chain over the model (and cache group), each page's parent and its token ids.

Two pages with the same hash hold the same tokens after the same prefix, for the same model and
layer group, so they hold the same keys and values: sharing is decided by these hashes (and a
token comparison on every hit, against collisions).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def page_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Chained content hash of a page: its parent's hash and its token ids."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def root_hash(fingerprint: str, group: int = 0) -> bytes:
    """The chain's root: pages of different models, or of different layer groups of one model,
    never share a hash. Group 0's root is the model's own."""
    salt = b"" if group == 0 else f"\0group:{group}".encode()
    return hashlib.sha256(b"kv-cache-root\0" + fingerprint.encode() + salt).digest()


def chain_hashes(root: bytes, tokens: Sequence[int], page_size: int,
                 start: Sequence[bytes] = ()) -> list[bytes]:
    """The chain hashes of every full page of ``tokens`` (``start``: the hashes already known
    for its first pages, extended rather than recomputed)."""
    hashes = list(start)
    parent = hashes[-1] if hashes else root
    first, n = len(hashes), len(tokens) // page_size
    if n <= first:
        return hashes
    # NOTE: the ids as bytes once (page_hash's encoding), hashed a page's slice at a time
    raw = memoryview(np.asarray(tokens[first * page_size : n * page_size],
                                dtype=np.int64).tobytes())
    step = 8 * page_size
    for at in range(0, len(raw), step):
        h = hashlib.sha256(parent)
        h.update(raw[at : at + step])
        parent = h.digest()
        hashes.append(parent)
    return hashes
