"""PageTable: exact block bookkeeping (blocks needed, truncation) and misuse errors."""

import pytest

from kv_cache.pages.block_table import PageTable


def table_10_tokens() -> PageTable:
    return PageTable(4, [7, 3, 5], 10)


def test_empty_table():
    t = PageTable(4)
    assert (t.page_size, t.blocks, t.num_tokens) == (4, [], 0)
    assert t.blocks_needed(0) == 0
    assert [t.blocks_needed(n) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


@pytest.mark.parametrize("page_size", [0, -1])
def test_page_size_must_be_positive(page_size):
    with pytest.raises(ValueError):
        PageTable(page_size)


@pytest.mark.parametrize(
    "blocks, num_tokens",
    [
        ([], 1),  # tokens without blocks
        ([1], 5),  # more tokens than the blocks hold
        ([1, 2], 4),  # last block would hold nothing
        ([1], 0),  # a block with no token at all
        ([1], -1),
    ],
)
def test_constructor_rejects_inconsistent_tables(blocks, num_tokens):
    with pytest.raises(ValueError):
        PageTable(4, blocks, num_tokens)


def test_constructor_with_blocks_copies_the_list():
    blocks = [9, 8]
    t = PageTable(4, blocks, 5)
    assert (t.blocks, t.num_tokens) == ([9, 8], 5)
    blocks.append(1)
    assert t.blocks == [9, 8]
    assert PageTable(4, [9, 8], 8).num_tokens == 8  # full last block is fine


def test_blocks_needed_counts_room_left_in_the_last_block():
    t = PageTable(4, [7], 3)
    assert t.blocks_needed(1) == 0 and t.blocks_needed(2) == 1 and t.blocks_needed(6) == 2
    assert PageTable(4, [7], 4).blocks_needed(1) == 1  # a full last block has no room


def test_truncate_returns_the_dropped_blocks():
    t = table_10_tokens()
    assert t.truncate(10) == []
    assert t.truncate(9) == []  # still 3 blocks: the last keeps 1 token
    assert (t.blocks, t.num_tokens) == ([7, 3, 5], 9)
    assert t.truncate(8) == [5]  # page-aligned: the last block goes
    assert (t.blocks, t.num_tokens) == ([7, 3], 8)
    assert t.truncate(1) == [3]
    assert (t.blocks, t.num_tokens) == ([7], 1)
    assert t.blocks_needed(4) == 1


@pytest.mark.parametrize("n", [-1, 11])
def test_truncate_out_of_range_raises_and_changes_nothing(n):
    t = table_10_tokens()
    with pytest.raises(ValueError):
        t.truncate(n)
    assert (t.blocks, t.num_tokens) == ([7, 3, 5], 10)


def test_free_all_empties_the_table():
    t = table_10_tokens()
    assert t.free_all() == [7, 3, 5]
    assert (t.blocks, t.num_tokens) == ([], 0)
    assert t.free_all() == []

