"""Page hashes: a chain over the model (and cache group), each page's parent, its token ids and,
for a page that holds an image's tokens, its extra keys.

Two pages with the same hash hold the same tokens after the same prefix, for the same model and
layer group, so they hold the same keys and values: sharing is decided by these hashes (and a
token comparison on every hit, against collisions). An image's placeholder ids are the same
whatever the image, so a page that holds any of an image's tokens also hashes the image's
identity and where the page starts in it (its extra keys, ``spans.page_extras``, as vLLM does
for multimodal inputs); its children chain over that hash, so a different image
changes the hash of the page that holds it and of every page after. A text page has no extra
keys and hashes exactly as it always has.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import numpy as np

from kv_cache.pages.spans import Extra, Span, page_extras

_EXTRA = struct.Struct("<qqI")  # offset, length, the image hash's byte length


def extras_bytes(extras: Sequence[Extra]) -> bytes:
    """The encoding of a page's extra keys that its hash takes after its token ids."""
    out = [b"\0extra"]
    for image, offset, length in extras:
        b = image.encode("utf-8")
        out.append(_EXTRA.pack(offset, length, len(b)) + b)
    return b"".join(out)


def page_hash(parent: bytes, tokens: Sequence[int], extras: Sequence[Extra] = ()) -> bytes:
    """Chained content hash of a page: its parent's hash, its token ids and its extra keys
    (none for a text page)."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    if extras:
        h.update(extras_bytes(extras))
    return h.digest()


def root_hash(fingerprint: str, group: int = 0) -> bytes:
    """The chain's root: pages of different models, or of different layer groups of one model,
    never share a hash. Group 0's root is the model's own."""
    salt = b"" if group == 0 else f"\0group:{group}".encode()
    return hashlib.sha256(b"kv-cache-root\0" + fingerprint.encode() + salt).digest()


def chain_hashes(root: bytes, tokens: Sequence[int], page_size: int,
                 start: Sequence[bytes] = (), spans: Sequence[Span] = ()) -> list[bytes]:
    """The chain hashes of every full page of ``tokens`` (``start``: the hashes already known
    for its first pages, extended rather than recomputed; ``spans``: the sequence's image spans,
    ``kv_cache.pages.spans``)."""
    hashes = list(start)
    parent = hashes[-1] if hashes else root
    first, n = len(hashes), len(tokens) // page_size
    if n <= first:
        return hashes
    # NOTE: the ids as bytes once (page_hash's encoding), hashed a page's slice at a time
    raw = memoryview(np.asarray(tokens[first * page_size : n * page_size],
                                dtype=np.int64).tobytes())
    step = 8 * page_size
    for i, at in enumerate(range(0, len(raw), step), start=first):
        h = hashlib.sha256(parent)
        h.update(raw[at : at + step])
        if spans:
            extras = page_extras(spans, i * page_size, page_size)
            if extras:
                h.update(extras_bytes(extras))
        parent = h.digest()
        hashes.append(parent)
    return hashes
