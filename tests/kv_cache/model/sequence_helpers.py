"""A small page pool for the sequence tests (2 layers, 2 kv heads, head_dim 3, pages of 4 tokens,
float32) and ``Run``: a sequence fed by a fake forward pass that checks its pages against what
it fed."""

import mlx.core as mx
import numpy as np

from kv_cache.pages.pool import PagePool
from kv_cache.model.sequence import PagedSequence

L, H, D, P = 2, 2, 3, 4
PAGE_BYTES = L * 2 * H * P * D * 4  # float32: 384
BUF_BYTES = L * 2 * (H * 256 * D * 4)  # one 256-step working buffer per layer, keys and values


def make_pool(pages: int = 64, policy: str = "lru") -> PagePool:
    return PagePool(L, H, D, page_size=P, dtype=mx.float32, max_bytes=PAGE_BYTES * pages,
                    policy=policy)


class Run:
    """A sequence fed by a fake forward pass; keeps the keys/values it fed, as
    ``[layers, 2, kv_heads, tokens, head_dim]`` (the pages' layout)."""

    def __init__(self, seq: PagedSequence, seed: int = 0, kv: np.ndarray | None = None):
        self.seq = seq
        self.rng = np.random.default_rng(seed)
        self.kv = np.zeros((L, 2, H, 0, D), np.float32) if kv is None else kv
        self.fetched: list[np.ndarray] = []  # what update_and_fetch returned, per layer

    def feed(self, ids) -> None:
        n = len(ids)
        new = self.rng.standard_normal((L, 2, H, n, D)).astype(np.float32)
        self.fetched = []
        for i, layer in enumerate(self.seq.prepare()):
            k, v = layer.update_and_fetch(mx.array(new[i, 0][None]), mx.array(new[i, 1][None]))
            self.fetched.append(np.stack([np.array(k[0]), np.array(v[0])]))
        self.seq.append_tokens(ids)
        self.kv = np.concatenate([self.kv, new], axis=3)

    def trim(self, n: int) -> None:
        self.kv = self.kv[:, :, :, : self.kv.shape[3] - n]
        self.fetched = []

    def check(self) -> None:
        """The pages hold what was fed, and the last forward pass saw all of it."""
        seq, pool = self.seq, self.seq.pool
        c = seq.committed
        assert seq.table.num_tokens == c
        if c:
            got = np.array(pool.gather(seq.table.blocks, c))
            np.testing.assert_array_equal(got, self.kv[:, :, :, :c])
            toks = sum((pool.tokens(b) for b in seq.table.blocks), ())[:c]
            assert list(toks) == seq.tokens[:c]
        for i, f in enumerate(self.fetched):
            np.testing.assert_array_equal(f, self.kv[i, :, :, : f.shape[2]])


def snapshot(pool, b):
    return pool.tokens(b), np.array(pool.data(b))


def same(pool, b, snap) -> bool:
    return pool.tokens(b) == snap[0] and np.array_equal(np.array(pool.data(b)), snap[1])


TOKS = list(range(100, 110))  # 10 tokens: pages of 4, 4 and 2


def committed_run(pool, n=10, seed=0) -> Run:
    r = Run(PagedSequence(pool), seed)
    r.feed(TOKS[:n])
    r.seq.commit()
    return r
