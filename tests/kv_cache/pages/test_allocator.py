"""BlockAllocator: exact ids, FIFO reuse, all-or-none, and one distinct error per failure."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_cache.pages.allocator import BlockAllocator
from kv_cache.errors import DoubleFreeError, InvalidBlockError, KVCacheError, OutOfBlocksError


def test_fresh_ids_come_in_increasing_order():
    a = BlockAllocator(4)
    assert (a.num_blocks, a.num_free, a.num_used) == (4, 4, 0)
    assert [a.alloc() for _ in range(4)] == [0, 1, 2, 3]
    assert (a.num_free, a.num_used) == (0, 4)
    assert all(a.is_allocated(b) for b in range(4))


def test_freed_ids_are_reused_first_in_first_out():
    a = BlockAllocator(4)
    assert a.alloc_n(4) == [0, 1, 2, 3]
    a.free(2)
    a.free(0)
    a.free(3)
    assert [a.is_allocated(b) for b in range(4)] == [False, True, False, False]
    assert [a.alloc(), a.alloc(), a.alloc()] == [2, 0, 3]


def test_fresh_ids_go_before_ids_freed_later():
    a = BlockAllocator(4)
    assert [a.alloc(), a.alloc()] == [0, 1]
    a.free(0)
    # 2 and 3 were never handed out: they are older in the free queue than the freed 0.
    assert [a.alloc(), a.alloc(), a.alloc()] == [2, 3, 0]
    with pytest.raises(OutOfBlocksError):
        a.alloc()


def test_alloc_n_is_all_or_none():
    a = BlockAllocator(3)
    assert a.alloc() == 0
    with pytest.raises(OutOfBlocksError):
        a.alloc_n(3)
    assert (a.num_free, a.num_used) == (2, 1)  # nothing was taken
    assert not a.is_allocated(1) and not a.is_allocated(2)
    assert a.alloc_n(2) == [1, 2]
    assert a.alloc_n(0) == []
    with pytest.raises(OutOfBlocksError):
        a.alloc_n(1)


def test_alloc_n_negative_is_misuse_not_exhaustion():
    a = BlockAllocator(3)
    with pytest.raises(ValueError) as e:
        a.alloc_n(-1)
    assert not isinstance(e.value, OutOfBlocksError)
    assert a.num_free == 3


def test_exhaustion_raises_out_of_blocks():
    a = BlockAllocator(2)
    a.alloc_n(2)
    with pytest.raises(OutOfBlocksError) as e:
        a.alloc()
    assert isinstance(e.value, KVCacheError)
    assert not isinstance(e.value, ValueError)  # capacity is not misuse
    assert a.num_used == 2


def test_zero_blocks():
    a = BlockAllocator(0)
    assert (a.num_free, a.num_used) == (0, 0)
    with pytest.raises(OutOfBlocksError):
        a.alloc()
    with pytest.raises(InvalidBlockError):
        a.free(0)


def test_negative_num_blocks_is_rejected():
    with pytest.raises(ValueError):
        BlockAllocator(-1)


def test_double_free_raises_double_free_error():
    a = BlockAllocator(3)
    b = a.alloc()
    a.free(b)
    with pytest.raises(DoubleFreeError) as e:
        a.free(b)
    assert isinstance(e.value, InvalidBlockError) and isinstance(e.value, ValueError)
    assert a.num_free == 3
    assert list(a._free) == [1, 2, 0]  # the failed free did not enqueue 0 twice


def test_free_of_a_never_allocated_id_is_a_double_free():
    a = BlockAllocator(3)
    with pytest.raises(DoubleFreeError):
        a.free(1)
    assert a.alloc_n(3) == [0, 1, 2]


@pytest.mark.parametrize("bad", [-1, 3, 100, 1.0, "0", None])
def test_invalid_ids_raise_invalid_block_error(bad):
    a = BlockAllocator(3)
    a.alloc_n(3)
    with pytest.raises(InvalidBlockError) as e:
        a.free(bad)
    assert not isinstance(e.value, DoubleFreeError)
    assert isinstance(e.value, ValueError)
    with pytest.raises(InvalidBlockError):
        a.is_allocated(bad)
    assert a.num_used == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=40))
def test_matches_a_reference_model(ops):
    """Random alloc/free sequences against a tiny FIFO reference."""
    n = 5
    a = BlockAllocator(n)
    free = list(range(n))
    for do_alloc, b in ops:
        if do_alloc:
            if free:
                assert a.alloc() == free.pop(0)
            else:
                with pytest.raises(OutOfBlocksError):
                    a.alloc()
        else:
            if b >= n:
                with pytest.raises(InvalidBlockError) as e:
                    a.free(b)
                assert not isinstance(e.value, DoubleFreeError)
            elif b in free:
                with pytest.raises(DoubleFreeError):
                    a.free(b)
            else:
                a.free(b)
                free.append(b)
        assert a.num_free == len(free)
        assert [a.is_allocated(i) for i in range(n)] == [i not in free for i in range(n)]
