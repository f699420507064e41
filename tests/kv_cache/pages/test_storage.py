"""Page data (``kv_cache.pages.storage``): storage only for written pages, and reads of pages as
one array (``gather``) or per layer (``gather_layers``).
"""

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.pages.pool import PagePool

from tests.kv_cache.pages.pool_helpers import D, H, L, P, kv, make_pool, np_, sealed


# -- storage grows on demand -----------------------------------------------------------------------


def test_storage_exists_only_for_written_pages():
    pool = make_pool(1000)
    assert pool.capacity == 1000 and len(pool.storage.arrays) == 0
    blocks = pool.allocate(10)
    assert len(pool.storage.arrays) == 0
    pool.write(blocks[3], kv(1), [1])
    assert list(pool.storage.arrays) == [blocks[3]]
    pool.release(blocks[3])
    assert len(pool.storage.arrays) == 0


def test_a_large_budget_reserves_no_memory():
    mx.eval(mx.zeros(1))
    before = mx.get_active_memory()
    pool = PagePool(32, 8, 128, page_size=32, dtype=mx.float16, max_bytes=8 << 30)
    assert pool.page_bytes == 4 << 20 and pool.capacity == 2048
    blocks = pool.allocate(500)  # ids only: 2 GiB of pages if storage were reserved
    assert len(blocks) == 500
    assert mx.get_active_memory() - before < (1 << 20)
    assert len(pool.storage.arrays) == 0


# -- gather ----------------------------------------------------------------------------------------


def test_gather_concatenates_pages():
    pool = make_pool(4)
    a = sealed(pool, (1, 2), base=0.0)
    b = sealed(pool, (3, 4), parent=pool.hash_of(a), base=100.0)
    (c,) = pool.allocate(1)
    pool.write(c, kv(1, 200.0), [5])
    full = np.concatenate([np_(kv(2, 0.0)), np_(kv(2, 100.0)), np_(kv(1, 200.0))], axis=3)
    assert np.array_equal(np_(pool.gather([a, b, c], 5)), full)
    assert np.array_equal(np_(pool.gather([a, b], 3)), full[:, :, :, :3])
    assert np.array_equal(np_(pool.gather([a], 1)), full[:, :, :, :1])
    assert pool.gather([a, b], 4).shape == (L, 2, H, 4, D)


@pytest.mark.parametrize("blocks, n", [([0, 1], 2), ([0, 1], 5), ([0], 3), ([0, 2], 4)])
def test_gather_rejects_a_token_count_that_does_not_fit(blocks, n):
    pool = make_pool(4)
    a = sealed(pool, (1, 2))
    b = sealed(pool, (3, 4), parent=pool.hash_of(a))
    (c,) = pool.allocate(1)
    pool.write(c, kv(1), [5])
    assert (a, b, c) == (0, 1, 2)
    with pytest.raises(ValueError):
        pool.gather(blocks, n)  # [0, 2] with 4: block 2 holds only 1 token


@pytest.mark.parametrize("n", [1, P, 2 * P + 1, 3 * P])
def test_gather_layers_with_and_without_room_hold_the_same_positions(n):
    """Per layer, keys and values of the first ``n`` positions, the same whether gathered
    into buffers with room (one copy per layer) or for a read-only view (one copy for all
    layers, sliced per layer)."""
    pool = make_pool(8)
    blocks, parent = [], None
    for i in range(-(-n // P)):
        blocks.append(sealed(pool, list(range(i * P, (i + 1) * P)), parent, base=100.0 * i))
        parent = pool.hash_of(blocks[-1])
    whole = np_(pool.gather(blocks, n))  # [layers, 2, heads, n, head_dim]
    for room in (0, 3):
        got = pool.gather_layers(blocks, n, room)
        assert len(got) == L
        for layer, (k, v) in enumerate(got):
            assert k.shape == v.shape == (1, H, n + room, D)
            assert np.array_equal(np_(k)[0, :, :n], whole[layer, 0])
            assert np.array_equal(np_(v)[0, :, :n], whole[layer, 1])
            assert not np_(k)[0, :, n:].any() and not np_(v)[0, :, n:].any()
