"""PagedLayerCache: mlx-lm's cache protocol, and a tiny random-weight llama whose greedy decoding on
the paged cache is token-identical to mlx-lm's KVCache (fresh, reused prefix, fork, trim)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, trim_prompt_cache
from mlx_lm.models.llama import Model, ModelArgs

from kv_cache.pages.pool import PagePool
from kv_cache.model.sequence import PagedSequence

# -- the protocol on its own -----------------------------------------------------------------------

H, D = 2, 3


def small_seq(layers: int = 1) -> PagedSequence:
    pool = PagePool(layers, H, D, page_size=4, dtype=mx.float32, max_bytes=1 << 20)
    return PagedSequence(pool)


def rand(n: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((1, H, n, D)).astype(np.float32))


def test_empty_layer():
    layer = small_seq().layers[0]
    assert (layer.offset, layer.size(), layer.empty(), layer.nbytes) == (0, 0, True, 0)
    assert layer.state == [] and layer.meta_state == "0"
    assert layer.is_trimmable()


def test_update_and_fetch_matches_kvcache_buffer_for_buffer():
    layer, ref = small_seq().layers[0], KVCache()
    for i, n in enumerate([3, 1, 250, 5, 300, 1]):
        k, v = rand(n, 2 * i), rand(n, 2 * i + 1)
        got, want = layer.update_and_fetch(k, v), ref.update_and_fetch(k, v)
        assert layer.offset == ref.offset and layer.size() == ref.size()
        assert layer.keys.shape == ref.keys.shape  # grows in the same 256-steps
        for g, w in zip(got, want):
            assert g.shape == (1, H, ref.offset, D)
            np.testing.assert_array_equal(np.array(g), np.array(w))
        assert layer.nbytes == ref.nbytes
    # 3, 4, 254 fit in 256; 259 -> 254 + 256 = 510; 559 -> 259 + 512 = 771; 560 fits.
    assert layer.keys.shape[2] == 771
    assert not layer.empty()
    ks, vs = layer.state
    assert ks.shape == (1, H, 560, D) and vs.shape == (1, H, 560, D)
    assert layer.meta_state == "560"


def test_update_and_fetch_returns_exactly_what_was_fed():
    layer = small_seq().layers[0]
    k1, v1, k2, v2 = rand(2, 1), rand(2, 2), rand(3, 3), rand(3, 4)
    layer.update_and_fetch(k1, v1)
    k, v = layer.update_and_fetch(k2, v2)
    np.testing.assert_array_equal(np.array(k), np.concatenate([np.array(k1), np.array(k2)], 2))
    np.testing.assert_array_equal(np.array(v), np.concatenate([np.array(v1), np.array(v2)], 2))
    assert layer.nbytes == 2 * (H * 256 * D * 4)


def test_trim_and_meta_state():
    layer = small_seq().layers[0]
    layer.update_and_fetch(rand(5, 0), rand(5, 1))
    assert layer.trim(2) == 2 and layer.offset == 3
    assert layer.trim(10) == 3 and layer.offset == 0
    layer.meta_state = "4"
    assert layer.offset == 4 and layer.meta_state == "4"


def test_state_setter():
    layer = small_seq().layers[0]
    k, v = rand(6, 0), rand(6, 1)
    layer.state = (k, v)
    assert layer.offset == 6
    got_k, got_v = layer.state
    np.testing.assert_array_equal(np.array(got_k), np.array(k))
    np.testing.assert_array_equal(np.array(got_v), np.array(v))
    layer.state = []  # ignored, as an empty state
    assert layer.offset == 6


@pytest.mark.parametrize("offset", [0, 5])
@pytest.mark.parametrize("N", [1, 3])
@pytest.mark.parametrize("return_array", [False, True])
@pytest.mark.parametrize("window_size", [None, 2])
def test_make_mask_matches_kvcache(offset, N, return_array, window_size):
    # As mlx-lm's create_attention_mask calls it.
    kwargs = {"return_array": return_array, "window_size": window_size}
    layer, ref = small_seq().layers[0], KVCache()
    if offset:
        layer.update_and_fetch(rand(offset, 0), rand(offset, 1))
        ref.update_and_fetch(rand(offset, 0), rand(offset, 1))
    got, want = layer.make_mask(N, **kwargs), ref.make_mask(N, **kwargs)
    if want is None or isinstance(want, str):
        assert got == want
    else:
        assert isinstance(got, mx.array)
        np.testing.assert_array_equal(np.array(got), np.array(want))
        expect = create_causal_mask(N, offset, window_size=window_size)
        np.testing.assert_array_equal(np.array(got), np.array(expect))


def test_mlx_lm_trim_prompt_cache_trims_every_layer():
    seq = small_seq(layers=3)
    for layer in seq.layers:
        layer.update_and_fetch(rand(5, 0), rand(5, 1))
    seq.append_tokens([1, 2, 3, 4, 5])
    assert trim_prompt_cache(seq.layers, 2) == 2
    assert [layer.offset for layer in seq.layers] == [3, 3, 3]
    seq.commit()
    assert seq.tokens == [1, 2, 3] and seq.committed == 3


# -- a tiny random-weight llama --------------------------------------------------------------------

VOCAB = 97
ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> Model:
    mx.random.seed(1234)
    args = ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
        rope_theta=10000.0, tie_word_embeddings=False,
    )
    m = Model(args)
    m.set_dtype(mx.float32)
    mx.eval(m.parameters())
    return m


def new_pool(model: Model, page_size: int, pages: int = 256) -> PagePool:
    layers, heads = len(model.layers), model.layers[0].self_attn.n_kv_heads
    head_dim = 64 // 4
    page_bytes = layers * 2 * heads * page_size * head_dim * 4
    return PagePool(layers, heads, head_dim, page_size=page_size, dtype=mx.float32,
                    max_bytes=pages * page_bytes)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


class Driver:
    """Runs the model over a cache: mlx-lm's KVCache list or a PagedSequence."""

    def __init__(self, model: Model, cache, commit_every: int = 1):
        self.model = model
        self.seq = cache if isinstance(cache, PagedSequence) else None
        self.cache = cache.layers if self.seq is not None else cache
        self.commit_every = commit_every
        self.tokens: list[int] = []
        self.logits: list[np.ndarray] = []  # last-position logits of every forward pass
        self.steps = 0

    def forward(self, ids) -> int:
        cache = self.seq.prepare() if self.seq is not None else self.cache
        out = self.model(mx.array([list(ids)]), cache=cache)
        last = out[0, -1]
        mx.eval(last)
        if self.seq is not None:
            self.seq.append_tokens(ids)
            self.steps += 1
            if self.steps % self.commit_every == 0:
                self.seq.commit()
        self.tokens += list(ids)
        self.logits.append(np.array(last))
        return int(np.argmax(self.logits[-1]))

    def generate(self, ids, n: int) -> list[int]:
        """Feed ``ids``, then decode ``n`` tokens greedily; returns the decoded tokens."""
        out = []
        nxt = self.forward(ids)
        for _ in range(n):
            out.append(nxt)
            nxt = self.forward([nxt])
        self.pending = nxt
        return out

    def trim(self, n: int) -> None:
        trim_prompt_cache(self.cache, n)
        del self.tokens[len(self.tokens) - n:]


def kv_driver(model):
    return Driver(model, [KVCache() for _ in model.layers])


def assert_same_run(paged: Driver, ref: Driver) -> None:
    assert paged.tokens == ref.tokens
    # A run that started from another's pages has only its own passes: compare the last ones.
    n = len(paged.logits)
    assert 0 < n <= len(ref.logits)
    for a, b in zip(paged.logits, ref.logits[-n:]):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=ATOL)
    if paged.seq is not None:
        assert paged.seq.tokens == ref.tokens


@pytest.mark.parametrize("page_size", [3, 4, 5])
def test_fresh_prompt_matches_kvcache(model, page_size):
    pool = new_pool(model, page_size)
    p = prompt(11, seed=1)  # not page-aligned for 3, 4 or 5
    seq = PagedSequence(pool)
    paged, ref = Driver(model, seq), kv_driver(model)
    out = paged.generate(p, 6)
    assert out == ref.generate(p, 6)
    assert len(set(out)) > 1  # the tiny model does not just repeat one token
    # Drop the working buffers: the next pass runs on KV gathered back from the pages.
    seq.drop_buffers()
    assert paged.generate([paged.pending], 5) == ref.generate([ref.pending], 5)
    assert_same_run(paged, ref)
    seq.commit()
    assert seq.committed == len(ref.tokens)
    got = np.array(pool.gather(seq.table.blocks, seq.committed))
    for i, c in enumerate(ref.cache):
        np.testing.assert_allclose(got[i, 0], np.array(c.state[0][0, :, : c.offset]), atol=ATOL)
        np.testing.assert_allclose(got[i, 1], np.array(c.state[1][0, :, : c.offset]), atol=ATOL)


@pytest.mark.parametrize("n_reuse", [8, 10, 17])
def test_reused_prefix_matches_kvcache(model, n_reuse):
    """A second conversation starts from the first one's pages (full pages from match_prefix, and
    at 10 and 17 the first one's partial tail: a sealed page, then its open page)."""
    P = 4
    pool = new_pool(model, P)
    first = Driver(model, PagedSequence(pool))
    ref_first = kv_driver(model)
    p1 = prompt(13, seed=2)
    assert first.generate(p1, 6) == ref_first.generate(p1, 6)  # 19 tokens
    a = first.seq
    assert len(a) == 19 and a.committed == 19
    snaps = {b: (pool.tokens(b), np.array(pool.data(b))) for b in a.table.blocks}

    p2 = a.tokens[:n_reuse] + prompt(5, seed=3)
    matched = pool.match_prefix(p2)
    assert matched == a.table.blocks[: n_reuse // P]
    blocks = a.prefix_blocks(n_reuse)
    assert blocks[: len(matched)] == matched
    b_seq = PagedSequence(pool, p2[:n_reuse], blocks)
    second = Driver(model, b_seq)
    second.tokens = p2[:n_reuse]
    ref_second = kv_driver(model)
    out = second.generate(p2[n_reuse:], 7)
    assert out == ref_second.generate(p2, 7)
    assert_same_run(second, ref_second)
    # The first conversation's pages did not change, and it goes on as if alone.
    for b, (toks, data) in snaps.items():
        assert pool.tokens(b) == toks and np.array_equal(np.array(pool.data(b)), data)
    assert first.generate([first.pending], 3) == ref_first.generate([ref_first.pending], 3)
    assert_same_run(first, ref_first)
    # Shared: the full pages both hold.
    shared = set(a.table.blocks) & set(b_seq.table.blocks)
    assert shared == set(blocks[: n_reuse // P])
    a.close()
    b_seq.close()
    assert all(v == 0 for v in pool.ref_counts().values())


def test_reused_prefix_after_close_from_match_prefix_only(model):
    pool = new_pool(model, 4)
    first = Driver(model, PagedSequence(pool))
    p1 = prompt(14, seed=4)
    first.generate(p1, 2)
    toks = list(first.seq.tokens)
    first.seq.close()
    p2 = toks[:15] + prompt(3, seed=5)
    blocks = pool.match_prefix(p2)
    assert len(blocks) == 3
    seq = PagedSequence(pool, p2[:12], blocks)
    d = Driver(model, seq, commit_every=2)
    d.tokens = p2[:12]
    ref = kv_driver(model)
    assert d.generate(p2[12:], 6) == ref.generate(p2, 6)
    assert_same_run(d, ref)


def test_fork_branches_match_kvcache(model):
    P = 4
    pool = new_pool(model, P)
    p = prompt(9, seed=6)
    root = Driver(model, PagedSequence(pool))
    ref_a = kv_driver(model)
    assert root.generate(p, 3) == ref_a.generate(p, 3)  # 12 tokens: page-aligned tail...
    root.forward([root.pending])  # ...13: the fork shares an open tail page
    ref_a.forward([ref_a.pending])
    ref_b = kv_driver(model)
    ref_b.generate(p, 3)
    ref_b.forward([ref_b.pending])
    branch = Driver(model, root.seq.fork())
    branch.tokens = list(root.tokens)
    tail = root.seq.table.blocks[-1]
    tail_snap = (pool.tokens(tail), np.array(pool.data(tail)))
    assert pool.ref_count(tail) == 2
    # Each continues with a different token, then greedily; steps interleaved.
    na, nb = root.forward([5]), branch.forward([6])
    ra, rb = ref_a.forward([5]), ref_b.forward([6])
    assert (na, nb) == (ra, rb)
    for _ in range(6):
        na, nb = root.forward([na]), branch.forward([nb])
        ra, rb = ref_a.forward([ra]), ref_b.forward([rb])
        assert (na, nb) == (ra, rb)
    assert_same_run(root, ref_a)
    assert_same_run(branch, ref_b)
    assert root.tokens[13] == 5 and branch.tokens[13] == 6
    assert root.tokens[14:] != branch.tokens[14:]
    # The root wrote first: it copied the shared tail; the branch then appended in place.
    assert root.seq.table.blocks[3] != tail and branch.seq.table.blocks[3] == tail
    n0 = len(tail_snap[0])
    assert pool.tokens(tail)[:n0] == tail_snap[0]
    assert np.array_equal(np.array(pool.data(tail))[:, :, :, :n0], tail_snap[1])
    assert pool.tokens(root.seq.table.blocks[3])[:n0] == tail_snap[0]


@pytest.mark.parametrize("how", ["seq.trim", "trim_prompt_cache", "drop_buffers"])
def test_trim_then_decode_other_tokens_matches_kvcache(model, how):
    pool = new_pool(model, 4)
    p = prompt(10, seed=7)
    d, ref = Driver(model, PagedSequence(pool)), kv_driver(model)
    assert d.generate(p, 6) == ref.generate(p, 6)
    d.forward([d.pending])
    ref.forward([ref.pending])  # 17 positions
    if how == "seq.trim":
        assert d.seq.trim(6) == 6
        del d.tokens[-6:]
    else:
        if how == "drop_buffers":
            d.seq.drop_buffers()
        d.trim(6)
    ref.trim(6)
    assert d.generate([11], 6) == ref.generate([11], 6)
    assert d.seq.tokens[11] == 11
    assert_same_run(d, ref)
    d.seq.drop_buffers()
    assert d.generate([d.pending], 2) == ref.generate([ref.pending], 2)
    assert_same_run(d, ref)
