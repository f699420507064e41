"""A small page pool for the pages tests (2 layers, 1 head, head_dim 2, pages of 2 tokens, float32:
64 bytes a page, so a budget is a page count), and pages made in it with known data."""

import mlx.core as mx
import numpy as np

from kv_cache.pages.pool import PagePool

L, H, D, P = 2, 1, 2, 2
PAGE_BYTES = L * 2 * H * P * D * 4  # float32: 64 bytes


def make_pool(pages: int, policy="lru", **kw) -> PagePool:
    return PagePool(L, H, D, page_size=P, dtype=mx.float32, max_bytes=PAGE_BYTES * pages,
                    policy=policy, **kw)


def kv(n: int, base: float = 0.0) -> mx.array:
    return (mx.arange(L * 2 * H * n * D, dtype=mx.float32) + base).reshape(L, 2, H, n, D)


def sealed(pool: PagePool, tokens, parent=None, base=0.0) -> int:
    """A full page written with ``tokens`` and sealed; held once by the caller."""
    (b,) = pool.allocate(1)
    pool.write(b, kv(len(tokens), base), tokens)
    return pool.seal(b, pool.root if parent is None else parent)


def cached(pool: PagePool, tokens, parent=None, base=0.0) -> int:
    b = sealed(pool, tokens, parent, base)
    pool.release(b)
    return b


def np_(a: mx.array) -> np.ndarray:
    return np.array(a)
