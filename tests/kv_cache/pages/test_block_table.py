"""PageTable: token positions to (block, offset), exact block bookkeeping and misuse errors."""

import pytest

from kv_cache.pages.block_table import PageTable


def table_10_tokens() -> PageTable:
    t = PageTable(4)
    t.append_tokens(10, [7, 3, 5])
    return t


def test_empty_table():
    t = PageTable(4)
    assert (t.page_size, t.blocks, t.num_tokens, t.capacity) == (4, [], 0, 0)
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
    assert (t.blocks, t.num_tokens, t.capacity) == ([9, 8], 5, 8)
    blocks.append(1)
    assert t.blocks == [9, 8]
    assert PageTable(4, [9, 8], 8).num_tokens == 8  # full last block is fine


def test_append_places_tokens_in_the_given_blocks():
    t = PageTable(4)
    assert t.blocks_needed(3) == 1
    t.append_tokens(3, [7])
    assert (t.blocks, t.num_tokens) == ([7], 3)
    assert t.blocks_needed(1) == 0 and t.blocks_needed(2) == 1 and t.blocks_needed(6) == 2
    t.append_tokens(1)  # fills block 7 exactly, no new block
    assert (t.blocks, t.num_tokens) == ([7], 4)
    t.append_tokens(6, [3, 5])
    assert (t.blocks, t.num_tokens, t.capacity) == ([7, 3, 5], 10, 12)
    t.append_tokens(0)
    assert t.num_tokens == 10


@pytest.mark.parametrize("n, blocks", [(3, []), (3, [1, 2]), (1, [1])])
def test_append_with_the_wrong_number_of_blocks_raises_and_changes_nothing(n, blocks):
    t = PageTable(4)
    t.append_tokens(2, [7])
    with pytest.raises(ValueError):
        t.append_tokens(n, blocks)
    assert (t.blocks, t.num_tokens) == ([7], 2)


def test_append_negative_raises():
    t = table_10_tokens()
    with pytest.raises(ValueError):
        t.append_tokens(-1)
    assert t.num_tokens == 10


def test_block_for_token_and_offset_in_block():
    t = table_10_tokens()
    assert [t.block_for_token(p) for p in range(10)] == [7] * 4 + [3] * 4 + [5] * 2
    assert [t.offset_in_block(p) for p in range(10)] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize("pos", [-1, 10, 11])
def test_positions_outside_the_table_raise_index_error(pos):
    t = table_10_tokens()  # capacity 12: position 10 has room but no token
    with pytest.raises(IndexError):
        t.block_for_token(pos)
    with pytest.raises(IndexError):
        t.offset_in_block(pos)


def test_tokens_in_block():
    t = table_10_tokens()
    assert [t.tokens_in_block(i) for i in range(3)] == [4, 4, 2]
    t.append_tokens(2)
    assert [t.tokens_in_block(i) for i in range(3)] == [4, 4, 4]


def test_truncate_returns_the_dropped_blocks():
    t = table_10_tokens()
    assert t.truncate(10) == []
    assert t.truncate(9) == []  # still 3 blocks: the last keeps 1 token
    assert (t.blocks, t.num_tokens) == ([7, 3, 5], 9)
    assert t.truncate(8) == [5]  # page-aligned: the last block goes
    assert (t.blocks, t.num_tokens) == ([7, 3], 8)
    assert [t.tokens_in_block(i) for i in range(2)] == [4, 4]
    assert t.truncate(1) == [3]
    assert (t.blocks, t.num_tokens) == ([7], 1)
    assert t.blocks_needed(4) == 1
    with pytest.raises(IndexError):
        t.block_for_token(1)


@pytest.mark.parametrize("n", [-1, 11])
def test_truncate_out_of_range_raises_and_changes_nothing(n):
    t = table_10_tokens()
    with pytest.raises(ValueError):
        t.truncate(n)
    assert (t.blocks, t.num_tokens) == ([7, 3, 5], 10)


def test_free_all_empties_the_table():
    t = table_10_tokens()
    assert t.free_all() == [7, 3, 5]
    assert (t.blocks, t.num_tokens, t.capacity) == ([], 0, 0)
    assert t.free_all() == []
    t.append_tokens(1, [2])
    assert t.blocks == [2]


def test_copy_is_independent():
    t = table_10_tokens()
    c = t.copy()
    assert (c.page_size, c.blocks, c.num_tokens) == (4, [7, 3, 5], 10)
    c.append_tokens(3, [1])
    t.truncate(2)
    assert (c.blocks, c.num_tokens) == ([7, 3, 5, 1], 13)
    assert (t.blocks, t.num_tokens) == ([7], 2)
