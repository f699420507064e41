"""Stateful property test of the paged cache: random sequences of new sequences from cached
prefixes, appends (a fake forward pass), commits, forks, trims, closes, allocation under pressure
and eviction, with the invariants checked after every step."""

from collections import Counter

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from mlx_lm.models.cache import trim_prompt_cache

from kv_cache.errors import OutOfBlocksError
from kv_cache.pages.pool import PagePool
from kv_cache.model.sequence import PagedSequence

L, H, D = 2, 1, 2
VOCAB = 3  # tiny, so that prefixes collide and pages are shared and deduplicated
MAX_LEN = 20
MAX_SEQS = 5


class FakeModel:
    """Keys and values of a position as a function of the token prefix up to it, like a causal
    model: equal prefixes give equal KV, so deduplicated pages hold the right data."""

    def __init__(self) -> None:
        self.memo: dict[tuple[int, ...], np.ndarray] = {}
        self.rng = np.random.default_rng(0)

    def position(self, prefix: tuple[int, ...]) -> np.ndarray:
        kv = self.memo.get(prefix)
        if kv is None:
            kv = self.memo[prefix] = self.rng.standard_normal((L, 2, H, D)).astype(np.float32)
        return kv

    def kv(self, tokens) -> np.ndarray:
        """``[layers, 2, kv_heads, len(tokens), head_dim]``."""
        t = tuple(tokens)
        if not t:
            return np.zeros((L, 2, H, 0, D), np.float32)
        return np.stack([self.position(t[: i + 1]) for i in range(len(t))], axis=3)


seq_index = st.integers(0, 1 << 16)


def assert_equal(actual: np.ndarray, want: np.ndarray) -> None:
    """``np.testing.assert_array_equal``, whose checks and report (most of this test's time when
    run on every step) run only when a plain comparison finds a difference."""
    if not (actual.shape == want.shape and np.array_equal(actual, want)):
        np.testing.assert_array_equal(actual, want)


class PagedCacheMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([2, 3, 4]),
        capacity=st.integers(4, 14),
        policy=st.sampled_from(["lru", "fifo", "s3fifo"]),
    )
    def setup(self, page_size, capacity, policy):
        page_bytes = L * 2 * H * page_size * D * 4
        self.pool = PagePool(L, H, D, page_size=page_size, dtype=mx.float32,
                             max_bytes=page_bytes * capacity, policy=policy)
        assert self.pool.capacity == capacity
        self.P = page_size
        self.model = FakeModel()
        self.seqs: dict[int, PagedSequence] = {}
        self.own: dict[int, list[int]] = {}  # our record of each sequence's tokens
        self.next_id = 0
        self.sealed: dict[bytes, tuple[tuple[int, ...], np.ndarray]] = {}

    # -- helpers -----------------------------------------------------------------------------------

    def pick(self, i: int) -> int:
        keys = sorted(self.seqs)
        return keys[i % len(keys)]

    def add(self, seq: PagedSequence, tokens: list[int]) -> int:
        sid, self.next_id = self.next_id, self.next_id + 1
        self.seqs[sid], self.own[sid] = seq, list(tokens)
        return sid

    def feed(self, sid: int, ids: list[int]) -> None:
        seq = self.seqs[sid]
        full = self.own[sid] + ids
        kv = self.model.kv(full)
        new = kv[:, :, :, len(self.own[sid]):]
        for i, layer in enumerate(seq.prepare()):
            k, v = layer.update_and_fetch(mx.array(new[i, 0][None]), mx.array(new[i, 1][None]))
            # The pass attends over everything: gathered pages plus the buffer plus the new.
            assert_equal(np.array(k[0]), kv[i, 0])
            assert_equal(np.array(v[0]), kv[i, 1])
        seq.append_tokens(ids)
        self.own[sid] = full

    # -- rules -------------------------------------------------------------------------------------

    @precondition(lambda self: len(self.seqs) < MAX_SEQS)
    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), max_size=10))
    def new_from_cached_prefix(self, tokens):
        blocks = self.pool.match_prefix(tokens)
        n = len(blocks) * self.P
        sid = self.add(PagedSequence(self.pool, tokens[:n], blocks), tokens[:n])
        if tokens[n:]:
            self.feed(sid, tokens[n:])

    @precondition(lambda self: 0 < len(self.seqs) < MAX_SEQS)
    @rule(i=seq_index, cut=st.integers(1, MAX_LEN),
          extra=st.lists(st.integers(0, VOCAB - 1), max_size=4))
    def new_from_partial_tail(self, i, cut, extra):
        src = self.seqs[self.pick(i)]
        if src.committed == 0:
            return
        n = 1 + (cut - 1) % src.committed
        tokens = list(src.tokens[:n])
        sid = self.add(PagedSequence(self.pool, tokens, src.prefix_blocks(n)), tokens)
        if extra:
            self.feed(sid, extra)

    @precondition(lambda self: self.seqs)
    @rule(i=seq_index, ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
          commit=st.booleans())
    def append(self, i, ids, commit):
        sid = self.pick(i)
        if len(self.own[sid]) + len(ids) <= MAX_LEN:
            self.feed(sid, ids)
        if commit:
            try:
                self.seqs[sid].commit()
            except OutOfBlocksError:
                pass

    @precondition(lambda self: self.seqs)
    @rule(i=seq_index)
    def commit(self, i):
        try:
            self.seqs[self.pick(i)].commit()
        except OutOfBlocksError:
            pass

    @precondition(lambda self: self.seqs)
    @rule(i=seq_index)
    def drop_buffers(self, i):
        try:
            self.seqs[self.pick(i)].drop_buffers()
        except OutOfBlocksError:
            pass

    @precondition(lambda self: 0 < len(self.seqs) < MAX_SEQS)
    @rule(i=seq_index, diverge=st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=4))
    def fork(self, i, diverge):
        """Fork; both branches then go on with different tokens (copy-on-write of a shared
        tail page) and commit, the parent first or the child first."""
        sid = self.pick(i)
        try:
            child = self.seqs[sid].fork()
        except OutOfBlocksError:
            return
        cid = self.add(child, self.own[sid])
        first, second = (sid, cid) if diverge[0] else (cid, sid)
        for k, j in enumerate((first, second)):
            ids = diverge[1:] if k == 0 else [(t + 1) % VOCAB for t in diverge[1:]]
            if len(self.own[j]) + len(ids) > MAX_LEN:
                continue
            self.feed(j, ids)
            try:
                self.seqs[j].commit()
            except OutOfBlocksError:
                pass

    @precondition(lambda self: self.seqs)
    @rule(i=seq_index, n=st.integers(0, 8), mlx_lm=st.booleans(),
          then=st.lists(st.integers(0, VOCAB - 1), max_size=3))
    def trim(self, i, n, mlx_lm, then):
        """Trim (the sequence's own trim or mlx-lm's trim_prompt_cache on its layers), then
        maybe go on with other tokens and commit (a partial sealed or open page is copied)."""
        sid = self.pick(i)
        seq = self.seqs[sid]
        if mlx_lm:
            got = trim_prompt_cache(seq.layers, n)
            seq.sync()  # the sequence follows its layers at its next step; read it now
        else:
            got = seq.trim(n)
        assert got == min(n, len(self.own[sid]))
        del self.own[sid][len(self.own[sid]) - got:]
        if then:
            self.feed(sid, then)
            try:
                seq.commit()
            except OutOfBlocksError:
                pass

    @precondition(lambda self: self.seqs)
    @rule(i=seq_index)
    def close(self, i):
        sid = self.pick(i)
        self.seqs.pop(sid).close()
        del self.own[sid]

    @rule(k=st.integers(1, 6))
    def allocate_under_pressure(self, k):
        """Someone else needs pages: cached pages are evicted, held ones never."""
        can = self.pool.can_allocate(k)
        try:
            blocks = self.pool.allocate(k)
        except OutOfBlocksError:
            assert not can
            return
        assert can and len(set(blocks)) == k
        for b in blocks:
            assert self.pool.ref_count(b) == 1 and self.pool.tokens(b) == ()
            self.pool.release(b)

    @rule()
    def evict_all_cached(self):
        before = self.pool.stats().cached_pages
        assert self.pool.evict_all_cached() == before
        assert self.pool.stats().cached_pages == 0

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def ref_counts_equal_holders(self):
        pool = self.pool
        holders = Counter(b for s in self.seqs.values() for b in s.table.blocks)
        rc = pool.ref_counts()
        for b, n in holders.items():
            # No page is freed while held.
            assert pool.allocator.is_allocated(b), f"block {b} held by {n} but free"
            assert rc.get(b) == n, f"block {b}: ref_count {rc.get(b)}, {n} holders"
        for b, n in rc.items():
            assert n == holders.get(b, 0), f"block {b}: ref_count {n}, {holders.get(b, 0)} holders"
            if n == 0:  # held by nothing: only a sealed, indexed page stays (cached)
                assert pool.is_sealed(b) and pool._meta[b].indexed
        assert pool.allocator.num_used == len(rc)
        assert pool.stats().cached_pages == sum(1 for n in rc.values() if n == 0)
        assert set(pool.storage.arrays) <= set(rc)
        assert pool.stats().used_bytes <= pool.max_bytes
        if not self.seqs:
            assert all(n == 0 for n in rc.values())

    @invariant()
    def sealed_pages_never_change(self):
        pool = self.pool
        for b in pool.ref_counts():
            if not pool.is_sealed(b):
                continue
            assert pool.num_tokens(b) == self.P
            h = pool.hash_of(b)
            toks, data = pool.tokens(b), np.array(pool.data(b))
            if h in self.sealed:
                old_toks, old_data = self.sealed[h]
                assert toks == old_toks and np.array_equal(data, old_data), f"block {b} changed"
            else:
                self.sealed[h] = (toks, data)

    @invariant()
    def index_is_leaf_closed(self):
        """Every indexed page's parent is indexed too: eviction only ever took leaves."""
        pool = self.pool
        indexed = {m.hash: m for m in pool._meta.values() if m.indexed}
        children = Counter(m.parent for m in indexed.values())
        assert dict(children) == pool.index.children
        for m in indexed.values():
            assert m.parent == pool.root or m.parent in indexed
        indexed_blocks = {m.hash: b for b, m in pool._meta.items() if m.indexed}
        assert indexed_blocks == pool.index.blocks
        assert len(pool.policy) == len(indexed)

    @invariant()
    def sequences_hold_what_they_were_fed(self):
        pool, P = self.pool, self.P
        for sid, seq in self.seqs.items():
            own = self.own[sid]
            assert seq.tokens == own and seq.offset == len(own) and len(seq) == len(own)
            c = seq.committed
            assert c <= len(own)
            assert seq.table.num_tokens == c and len(seq.table.blocks) == -(-c // P)
            if c:
                want = self.model.kv(own[:c])
                assert_equal(np.array(pool.gather(seq.table.blocks, c)), want)
                page_tokens = sum((pool.tokens(b) for b in seq.table.blocks), ())
                assert list(page_tokens[:c]) == own[:c]
            for i, layer in enumerate(seq.layers):
                if layer.keys is not None:
                    k, v = layer.state
                    want = self.model.kv(own)
                    assert_equal(np.array(k[0]), want[i, 0])
                    assert_equal(np.array(v[0]), want[i, 1])

    def teardown(self):
        pool = getattr(self, "pool", None)
        if pool is None:
            return
        for seq in self.seqs.values():
            seq.close()
        self.seqs.clear()
        assert all(n == 0 for n in pool.ref_counts().values())
        pool.evict_all_cached()
        assert pool.allocator.num_free == pool.capacity
        assert pool.ref_counts() == {} and pool.storage.arrays == {} and pool.index.blocks == {}
        assert pool.index.children == {} and len(pool.policy) == 0


PagedCacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPagedCache = PagedCacheMachine.TestCase
