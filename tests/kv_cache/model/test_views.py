"""Prefix views: when running sequences take them up."""

from __future__ import annotations

import mlx.core as mx

from kv_cache.model.sequence import PagedSequence
from kv_cache.model.views import PrefixViews
from tests.kv_cache.model.sequence_helpers import TOKS, Run, make_pool


def test_a_new_view_leaves_running_sequences_alone_until_their_own_next_step():
    """Starting a sequence that makes a view over another's pages does not touch the other's
    buffers; the other takes the view up when it prepares its next forward pass (its buffers then
    hold only the positions after the view), and reads what it fed."""
    pool = make_pool()
    views = PrefixViews(pool)
    a = Run(PagedSequence(pool, views=views))
    a.feed(TOKS)
    a.seq.commit()  # pages of 4, 4 and 2: the first two sealed
    before = [(layer.keys, layer.base) for layer in a.seq.paged_layers]
    b = PagedSequence(pool, TOKS[:8], a.seq.table.blocks[:2], views=views)
    assert b.view is views.views[0] and b.view_len == 8
    assert a.seq.view is None
    assert [(layer.keys, layer.base) for layer in a.seq.paged_layers] == before
    a.feed([7])  # a's next step
    assert a.seq.view is b.view and b.view.users == 2
    for i, layer in enumerate(a.seq.paged_layers):
        assert layer.base == 8 and layer.view is b.view
        assert a.fetched[i].shape[2] == 3  # positions 8, 9 and the new 10
        assert mx.array_equal(mx.array(a.fetched[i]), mx.array(a.kv[i, :, :, 8:])).item()
    b.close()
    assert views.views == [a.seq.view]
    a.seq.close()
    assert views.views == []
