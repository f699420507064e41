"""The own-key mask of the split attention path (``kv_cache.model.masks``)."""

from __future__ import annotations

import mlx.core as mx

from kv_cache.model.reads import Reads
from kv_cache.model.masks import build_mask


def reads(own_start, q_start, n, **kw) -> Reads:
    k = mx.zeros((1, 1, n, 4))
    return Reads(None, None, k, k, own_start, q_start, 0, **kw)


def visible(mask) -> list[list[int]]:
    return (mask[0, 0, 0] == 0).astype(mx.int32).tolist()


def test_causal_and_one_query_seeing_all_needs_no_mask():
    assert build_mask([reads(0, 3, 4)], [4], 1, 4) is None
    assert visible(build_mask([reads(0, 1, 3)], [3], 2, 3)) == [[1, 1, 0], [1, 1, 1]]


def test_pages_sealed_inside_the_pass_are_read_decoded_by_the_later_queries():
    """Pages of 2; own keys 0..4 (page 0 decoded before the pass, floats from 2), queries 2..4,
    then the decoded copy of page 1 (positions 2, 3): query 4 reads page 1 as the copy, queries
    2 and 3 read it as float."""
    r = reads(0, 2, 5 + 2, block=2, float_from=2, copies=2)
    got = visible(build_mask([r], [7], 3, 7))
    #          0  1  2  3  4 | copies 2  3
    assert got == [[1, 1, 1, 0, 0, 0, 0],
                   [1, 1, 1, 1, 0, 0, 0],
                   [1, 1, 0, 0, 1, 1, 1]]


def test_rows_of_a_batch_keep_their_own_views_and_padding():
    a = reads(0, 2, 4, block=2, float_from=2)  # queries 2, 3: one page, no copy
    b = reads(0, 3, 5 + 2, block=2, float_from=2, copies=2)  # queries 3, 4: page 1 sealed
    got = build_mask([a, b], [4, 7], 2, 7)
    assert visible(got[0:1]) == [[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0]]
    assert visible(got[1:2]) == [[1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 1, 1, 1]]
