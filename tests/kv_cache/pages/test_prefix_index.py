"""The prefix index (``kv_cache.pages.prefix_index``) through the pool: a page is found by its
chain (the same tokens after another parent are another page), and a hash hit is checked
against the page's tokens.
"""

import kv_cache.pages.prefix_index as prefix_index_mod
import kv_cache.pages.pool as pool_mod

from tests.kv_cache.pages.pool_helpers import kv, make_pool, sealed


def test_same_tokens_under_another_parent_is_another_page():
    pool = make_pool(4)
    a = sealed(pool, (1, 2))
    b = sealed(pool, (1, 2), parent=pool.hash_of(a))
    assert b != a and pool.ref_count(a) == 1 and pool.ref_count(b) == 1
    assert pool.match_prefix([1, 2, 1, 2]) == [a, b]


def test_a_hash_hit_compares_tokens_too(monkeypatch):
    """With every hash colliding, only the tokens can tell pages apart."""
    monkeypatch.setattr(pool_mod, "page_hash", lambda parent, tokens, extras=(): b"collision")
    monkeypatch.setattr(prefix_index_mod, "chain_hashes",
                        lambda root, tokens, P, start=(), spans=():
                        list(start) + [b"collision"] * (len(tokens) // P - len(start)))
    pool = make_pool(4)
    a = sealed(pool, (1, 2))
    b = sealed(pool, (3, 4))
    assert b != a  # not deduplicated onto a page with other tokens
    assert pool.is_sealed(b) and pool.hash_of(b) == pool.hash_of(a)
    assert pool.match_prefix([1, 2]) == [a]
    assert pool.match_prefix([3, 4]) == []  # b is not indexed, a's tokens differ
    pool.release(b)  # not indexed: not cached, freed
    assert not pool.allocator.is_allocated(b)
    pool.release(a)
    assert pool.stats().cached_pages == 1
    c = pool.add_sealed(pool.root, (3, 4), kv(2))
    assert c != a and pool.ref_count(a) == 0
