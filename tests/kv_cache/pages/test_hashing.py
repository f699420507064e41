"""Page hashes with extra keys: a text page's hash is what it always was; an image's identity
changes the hash of the page that holds it and of every page after."""

from __future__ import annotations

import hashlib
import struct

from kv_cache.pages.hashing import chain_hashes, page_hash, root_hash
from kv_cache.pages.spans import as_spans, page_extras

P = 4
A, B = "a" * 64, "b" * 64
TOKENS = list(range(100, 124))  # six pages


def old_page_hash(parent: bytes, tokens) -> bytes:
    """A page's hash as it was computed before images: sha256(parent, int64 little-endian ids)."""
    return hashlib.sha256(parent + b"".join(struct.pack("<q", t) for t in tokens)).digest()


def old_chain(root: bytes, tokens) -> list[bytes]:
    out, parent = [], root
    for i in range(len(tokens) // P):
        parent = old_page_hash(parent, tokens[i * P : (i + 1) * P])
        out.append(parent)
    return out


def test_a_text_page_hashes_byte_for_byte_as_before():
    root = root_hash("tiny")
    assert page_hash(root, TOKENS[:P]) == old_page_hash(root, TOKENS[:P])
    assert page_hash(root, TOKENS[:P], ()) == old_page_hash(root, TOKENS[:P])
    assert chain_hashes(root, TOKENS, P) == old_chain(root, TOKENS)
    # spans elsewhere in the sequence leave the text pages before them as they were
    spans = as_spans([(13, 6, A)])
    assert chain_hashes(root, TOKENS, P, spans=spans)[:3] == old_chain(root, TOKENS)[:3]
    assert chain_hashes(root, TOKENS, P, spans=()) == old_chain(root, TOKENS)


def test_an_image_changes_its_pages_hash_and_every_one_after():
    root = root_hash("tiny")
    a = chain_hashes(root, TOKENS, P, spans=as_spans([(9, 6, A)]))
    b = chain_hashes(root, TOKENS, P, spans=as_spans([(9, 6, B)]))
    text = chain_hashes(root, TOKENS, P)
    assert a[:2] == b[:2] == text[:2]  # pages 0 and 1 hold no image
    assert all(x != y and x != t and y != t for x, y, t in zip(a[2:], b[2:], text[2:]))
    assert a == chain_hashes(root, TOKENS, P, spans=as_spans([(9, 6, A)]))  # deterministic
    # the same image one position further is another page content
    assert chain_hashes(root, TOKENS, P, spans=as_spans([(10, 6, A)]))[2] != a[2]


def test_the_chain_and_the_page_hash_agree_and_the_chain_extends():
    root, spans = root_hash("tiny"), as_spans([(5, 9, A)])
    chain = chain_hashes(root, TOKENS, P, spans=spans)
    parent = root
    for i, h in enumerate(chain):
        assert h == page_hash(parent, TOKENS[i * P : (i + 1) * P], page_extras(spans, i * P, P))
        parent = h
    assert chain_hashes(root, TOKENS, P, start=chain[:2], spans=spans) == chain
