"""Image spans: how far two sequences' images agree, and each page's extra keys."""

from __future__ import annotations

import pytest

from kv_cache.pages.spans import (Span, agree, as_spans, before, extras_agree, head_extras,
                                  outside, page_extras)

A, B = "a" * 64, "b" * 64


def test_spans_are_checked_and_put_in_order():
    assert as_spans([(10, 4, A), [2, 3, B]]) == (Span(2, 3, B), Span(10, 4, A))
    for bad in [(0, 0, A)], [(-1, 2, A)], [(0, 2, "")], [(0, 2, 7)], [(0, 2)], \
            [(0, 4, A), (3, 2, B)], [(0.5, 2, A)]:
        with pytest.raises(ValueError):
            as_spans(bad)


def test_a_reuse_never_ends_inside_an_image():
    spans = as_spans([(8, 6, A)])
    assert [outside(n, spans) for n in (7, 8, 9, 13, 14, 15)] == [7, 8, 8, 8, 14, 15]


def test_spans_agree_up_to_the_first_that_differs():
    one, other = as_spans([(4, 4, A), (12, 4, A)]), as_spans([(4, 4, A), (12, 4, B)])
    assert agree(20, one, one) == 20
    assert agree(20, one, other) == 12  # the second image differs: up to its start
    assert agree(10, one, other) == 10  # both images before 10 agree; 10 is in neither
    assert agree(6, one, other) == 4  # inside the first image: back to its start
    assert agree(20, one, ()) == 4  # a text sequence against one with images
    assert agree(20, (), ()) == 20
    # the same image at another place, or of another length, is another span
    assert agree(20, as_spans([(4, 4, A)]), as_spans([(5, 4, A)])) == 4
    assert agree(20, as_spans([(4, 4, A)]), as_spans([(4, 5, A)])) == 4
    assert before(one, 12) == one[:1] and before(one, 13) == one


def test_page_extras_name_each_image_a_page_holds_and_where_the_page_starts_in_it():
    spans = as_spans([(6, 5, A), (11, 2, B)])
    assert page_extras(spans, 0, 4) == ()  # a text page
    assert page_extras(spans, 4, 4) == ((A, -2, 5),)  # the image begins inside the page
    assert page_extras(spans, 8, 4) == ((A, 2, 5), (B, -3, 2))
    assert page_extras(spans, 12, 4) == ((B, 1, 2),)
    assert page_extras(spans, 16, 4) == ()
    assert head_extras(page_extras(spans, 8, 4), 3) == ((A, 2, 5),)


def test_pages_agree_as_far_as_their_images_do():
    same = page_extras(as_spans([(5, 2, A)]), 4, 4)
    other = page_extras(as_spans([(5, 2, B)]), 4, 4)
    assert extras_agree(4, same, same) == 4
    assert extras_agree(4, same, other) == 1  # the image starts at the page's second position
    assert extras_agree(1, same, other) == 1
    assert extras_agree(4, (), ()) == 4
    longer = page_extras(as_spans([(5, 9, A)]), 4, 4)
    assert extras_agree(4, longer, longer) == 1  # the image runs on past these positions
