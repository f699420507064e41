"""A running batch: the cache list that lets one forward pass decode many sequences.

``batch_caches(seqs)`` gives, per cache slot of the model, an object that speaks mlx-lm's cache
protocol for all of them at once: a ``BatchLayer`` over their paged layers (each sequence's new
keys and values go to its own buffer; ``kv_cache.model.attention`` reads the shared prefix views once
per group) or an mlx-lm ``ArraysCache`` with their recurrent states stacked along the batch axis.
``finish_batch`` puts the stepped states back. Sequences stay what they are: a batch is built for
one step and dropped, so requests join and leave between any two steps.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from kv_cache.model.attention import fetched
from kv_cache.model.reads import Reads
from kv_cache.model.layer_cache import PagedLayerCache
from kv_cache.model.sequence import PagedSequence


class BatchLayer:
    """One paged layer of every sequence in the batch (one new position each per step)."""

    def __init__(self, members: Sequence[PagedLayerCache], lengths: Sequence[int] | None = None,
                 ragged: bool = False):
        """``lengths``: new positions per member this step (default one each; a prompt batch
        pads shorter members on the right, and their padding is not stored). ``ragged``: the
        pass has one row per new position instead, ``lengths[i]`` rows of member ``i`` one
        after the other, each row one token (``ragged_caches``)."""
        self.members = list(members)
        self.lengths = list(lengths) if lengths is not None else None
        self.ragged = self.lengths if ragged else None
        self.window = self.members[0].window

    @property
    def offset(self) -> mx.array:
        if self.ragged is not None:  # each row's own position
            return mx.array([m.offset + j for m, n in zip(self.members, self.ragged)
                             for j in range(n)])
        return mx.array([m.offset for m in self.members])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.ragged is not None:  # rows [n, heads, 1, dim] of a member -> [1, heads, n, dim]
            at = 0
            for m, n in zip(self.members, self.ragged):
                m.update_and_fetch(keys[at : at + n].swapaxes(0, 2),
                                   values[at : at + n].swapaxes(0, 2))
                at += n
            fetched(keys, self)
            return keys, values
        quant = self.members[0].quant  # pages in bits: code the whole batch in one call
        words = None
        if quant is not None:
            keys, values, *words = quant.fresh(keys, values)
        for i, m in enumerate(self.members):
            n = keys.shape[2] if self.lengths is None else self.lengths[i]
            stored = None if words is None or words[0] is None \
                else tuple(w[i : i + 1, :, :n] for w in words)
            if n == keys.shape[2]:
                m.update_and_fetch(keys[i : i + 1], values[i : i + 1], stored)
            else:
                m.update_and_fetch(keys[i : i + 1, :, :n], values[i : i + 1, :, :n], stored)
        fetched(keys, self)
        return keys, values

    def reads(self) -> list[Reads]:
        return [m.read() for m in self.members]

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        return None  # attention() masks each sequence's own positions itself

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False

    @property
    def state(self):
        raise NotImplementedError("a batch layer is a view for one step")

    @property
    def nbytes(self) -> int:
        return 0


def batch_caches(seqs: Sequence[PagedSequence], lengths: Sequence[int] | None = None) -> list:
    """The model's cache list for one step of ``seqs`` together: one new position each, or
    ``lengths[i]`` prompt positions each (right-padded; no recurrent state then). Each sequence
    is prepared for the step first (``PagedSequence.prepare``)."""
    caches = [s.prepare() for s in seqs]
    out: list = []
    for slot, layer in enumerate(caches[0]):
        if isinstance(layer, PagedLayerCache):
            out.append(BatchLayer([c[slot] for c in caches], lengths))
        elif lengths is not None:
            raise ValueError("padded prompt batches would corrupt a recurrent state")
        else:  # recurrent state: stacked along the batch axis
            stacked = ArraysCache(len(layer.cache))
            stacked.cache = [mx.concatenate([c[slot].cache[j] for c in caches], axis=0)
                             for j in range(len(layer.cache))]
            out.append(stacked)
    return out


def can_go_ragged(pool) -> bool:
    """Whether passes over the sequences of ``pool`` (a ``PagePool``) can be ragged
    (``ragged_caches``): no recurrent state and no pages in bits (their fresh positions are
    coded for a whole batch array at once)."""
    return not pool.spec.has_state and all(g.quant is None for g in pool.groups)


def ragged_caches(seqs: Sequence[PagedSequence], lengths: Sequence[int]) -> list:
    """The model's cache list for a ragged pass: one row per new position, ``lengths[i]`` rows
    of ``seqs[i]`` one after the other, each row one token at its own position (the offsets a
    batched decode step already gives per row). No row is padding, so the model's matrix
    products and output head run over real positions only; attention regroups each
    sequence's rows (``kv_cache.model.attention``). Only where ``can_go_ragged``."""
    caches = [s.prepare() for s in seqs]
    return [BatchLayer([c[slot] for c in caches], lengths, ragged=True)
            for slot in range(len(caches[0]))]


def finish_batch(seqs: Sequence[PagedSequence], caches: list) -> None:
    """Give each sequence its row of the stepped recurrent states."""
    for slot, c in enumerate(caches):
        if isinstance(c, ArraysCache):
            for i, s in enumerate(seqs):
                s.layers[slot].cache = [a[i : i + 1] for a in c.cache]
