"""A sequence: its token ids, one page table per cache group, recurrent-state layers, and one
mlx-lm cache object per cache slot of the model.

The sequence owns its layer caches and does all the work that needs more than one layer (or the
pages) between forward passes: ``prepare()`` before a pass (follow mlx-lm's trims, take up a new
shared prefix view, gather buffers from the pages), ``append_tokens`` and ``commit`` after. A
layer cache never calls back into its sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from kv_cache.pages.hashing import chain_hashes, page_hash
from kv_cache.pages.spans import Span, as_spans, page_extras
from kv_cache.model.channel_cache import ChannelKeysCache
from kv_cache.model.layer_cache import PagedLayerCache, layer_cache
from kv_cache.model.page_writes import release_before, write_group
from kv_cache.pages.pool import PagePool
from kv_cache.pages.block_table import PageTable
from kv_cache.model.state_points import StatePoints
from kv_cache.tokens import token_list

if TYPE_CHECKING:
    from kv_cache.model.views import PrefixView, PrefixViews

Snapshot = list[list[mx.array]]  # per recurrent-state slot, its arrays


@dataclass(frozen=True, slots=True)
class MemoryReport:
    length: int  # tokens
    own_bytes: int  # pages this sequence alone holds
    shared_bytes: int  # pages held by someone else too
    working_bytes: int  # contiguous working buffers (and recurrent state) while it runs
    divergence_point: int  # first token position on a page this sequence alone holds

    @property
    def total_bytes(self) -> int:
        return self.own_bytes + self.shared_bytes


def copy_snapshot(snapshot: Snapshot) -> Snapshot:
    # NOTE: mx.array(a) is a new array: in-place updates of one never show in the other.
    return [[mx.array(a) for a in arrays] for arrays in snapshot]


class PagedSequence:
    """One conversation's cache: pass ``seq.prepare()`` (``seq.layers``, made ready for the
    pass) as the ``cache`` of an mlx-lm model.

    After a forward pass over token ids, call ``append_tokens(ids)``; ``commit()`` copies the new
    positions into pages (open tail page written in place when the sequence alone holds it, copied
    first otherwise; full pages sealed and deduplicated; pages a sliding window no longer reads
    released). ``close()`` drops every hold.
    """

    def __init__(self, pool: PagePool, tokens: Sequence[int] = (),
                 blocks: Sequence[int] | Sequence[Sequence[int | None]] = (),
                 state: Snapshot | None = None, views: PrefixViews | None = None,
                 spans: Sequence[Span] = ()):
        """Start from ``tokens`` whose keys and values the pool already holds: ``blocks`` per
        cache group (a plain list for a one-group pool; None where a sliding window no longer
        reads a page), and ``state``, the recurrent state after ``tokens`` (a reused prefix; the
        sequence takes its own holds and copies). With ``views``, the full-attention layers read
        the leading pages through a shared prefix view (``kv_cache.model.attention``) and keep only
        the rest in their buffers; views made later are taken up by ``prepare``. ``spans``: the
        image spans (``kv_cache.pages.spans``) of the whole prompt this sequence runs, so that the
        pages it seals carry them in their hashes."""
        self.pool = pool
        self.spans: tuple[Span, ...] = as_spans(spans)
        self.views = views
        self.view: PrefixView | None = None
        self.view_len = 0
        spec = pool.spec
        n, P = len(tokens), pool.page_size
        tables = list(blocks)
        if tables and not isinstance(tables[0], (list, tuple)):
            tables = [tables]
        if not tables:
            tables = [[] for _ in spec.groups]
        assert len(tables) == len(spec.groups), f"{len(tables)} tables for {len(spec.groups)} groups"
        self.tables = [PageTable(P, list(t), n) for t in tables]
        for t in self.tables:
            pool.hold_all(t.blocks)
        self.tokens: list[int] = token_list(tokens)
        self.committed = n
        self._chains: list[list[bytes]] = [[] for _ in spec.groups]
        if spec.has_state and n and state is None:
            raise ValueError("a model with recurrent state resumes only from a state snapshot")
        layers: list = [None] * spec.num_slots
        self.group_layers: list[list[PagedLayerCache]] = []
        for g in spec.groups:
            cls = [ChannelKeysCache(g.kind, i, P, n, g.quant) if g.quant is not None
                   and g.quant.key_block else layer_cache(g.kind, i, P, n, g.quant)
                   for i in g.layers]
            self.group_layers.append(cls)
            for i, layer in zip(g.layers, cls):
                layers[i] = layer
        self.state_layers: list[ArraysCache] = []
        restored = copy_snapshot(state) if state is not None and n else None
        for si, s in enumerate(spec.states):
            c = ArraysCache(len(s.shapes))
            if restored is not None:
                c.cache = list(restored[si])
            layers[s.layer] = c
            self.state_layers.append(c)
        self.layers = layers
        self.paged_layers = [layer for g in self.group_layers for layer in g]
        self.points = StatePoints()  # state snapshots at message boundaries (state_points.py)
        self.closed = False
        self._seen = 0  # the views made up to here were looked at (PrefixViews.since)
        if views is not None:
            view, c = views.acquire([t.blocks for t in self.tables], n)
            self._seen = views.made
            if view is not None:
                self._use_view(view, c)

    def adopt(self, view: PrefixView) -> None:
        """Read the first ``view.length`` positions from ``view`` when this sequence's pages
        begin with the view's pages: the buffers drop those positions (between forward passes
        only)."""
        c = view.length
        if c <= self.view_len or self.committed < c:
            return
        P = self.pool.page_size
        for g, blocks in zip(view.groups, view.tables):
            if tuple(self.tables[g].blocks[: c // P]) != blocks:
                return
        if self.view is not None:
            self.views.release(self.view)
        view.users += 1
        self._use_view(view, c)

    def _use_view(self, view: PrefixView | None, c: int) -> None:
        self.view, self.view_len = view, c
        for g in self.views.groups:
            for layer in self.group_layers[g]:
                layer.use_view(view, c)

    @property
    def table(self) -> PageTable:
        """Group 0's page table."""
        return self.tables[0]

    @property
    def offset(self) -> int:
        return self.paged_layers[0].offset if self.paged_layers else len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    # -- running --------------------------------------------------------------------------------

    def prepare(self) -> list:
        """The model's cache list made ready for the next forward pass (call before each):
        follows what mlx-lm's ``trim`` did to the layers (``sync``), takes up a prefix view made
        since the last step that begins with this sequence's pages (``adopt``), and gathers the
        buffers from the pages where they hold none yet (a sequence started from stored pages,
        or after ``drop_buffers``)."""
        self.sync()
        views = self.views
        if views is not None and views.made != self._seen:
            for view in views.since(self._seen):
                self.adopt(view)
            self._seen = views.made
        for layers in self.group_layers:
            first = layers[0]
            if first.keys is None and first.offset > first.keep_from(first.offset):
                self.materialize()
                break
        return self.layers

    def append_tokens(self, ids: Sequence[int]) -> None:
        """Record the token ids of the positions the last forward pass added."""
        self.sync()
        self.tokens.extend(int(t) for t in ids)
        assert len(self.tokens) == self.offset, (
            f"{len(self.tokens)} token ids for {self.offset} cached positions"
        )
        self.points.reached(len(self.tokens), self.state_snapshot)

    def has_buffers(self) -> bool:
        return all(layer.keys is not None for layer in self.paged_layers) or self.committed == 0

    def materialize(self) -> None:
        """Gather the committed prefix from the pages into every layer's working buffer (for a
        sliding window, only what it still reads)."""
        if self.committed == 0:
            return
        P, step, end = self.pool.page_size, PagedLayerCache.step, self.committed
        for table, layers, spec in zip(self.tables, self.group_layers, self.pool.groups):
            base = layers[0].keep_from(end)
            n = end - base
            if n == 0:  # all in the shared prefix view: the buffers start empty
                for layer in layers:
                    layer.base = base
                continue
            room = -(-(n + 1) // step) * step - n
            blocks = table.blocks[base // P : -(-end // P)]
            assert None not in blocks, "a page the window reads was released"
            gathered = self.pool.gather_layers(blocks, n, room)
            # pages in bits: a window that may write a page again after a trim keeps its words
            rows = self.pool.gather(blocks, n) if spec.quant is not None \
                and not spec.kind.reads_all else None
            for i, (layer, (keys, values)) in enumerate(zip(layers, gathered)):
                layer.load(keys, values, base, None if rows is None else rows[i])

    def drop_buffers(self) -> None:
        """Free the working buffers (after a commit); the next forward pass gathers again."""
        self.commit()
        for layer in self.paged_layers:
            layer.drop_buffer()

    def commit(self) -> None:
        """Copy every position not yet in pages into pages; release the pages that a sliding
        window no longer reads."""
        self.sync()
        start, end = self.committed, self.offset
        assert len(self.tokens) == end, f"{len(self.tokens)} token ids for {end} positions"
        if end == start:
            return
        written: list[tuple[int, int]] = []
        try:
            for g in range(len(self.tables)):
                # NOTE: a commit that ran out of pages (``OutOfBlocksError``) is tried again once
                # its caller made room: the groups it wrote before that are not written twice.
                if self.tables[g].num_tokens != end:
                    written += [(g, i) for i in write_group(
                        self.pool, g, self.tables[g], self.group_layers[g], self.tokens, start,
                        end)]
        finally:
            self._seal(written)
        self.committed = end
        P = self.pool.page_size
        for table, spec in zip(self.tables, self.pool.groups):  # a window's pages behind it
            release_before(self.pool, table.blocks, spec.kind.keep_from(end, P))

    def _seal(self, written: list[tuple[int, int]]) -> None:
        """Evaluate the pages ``written`` (group, index) and seal the full ones."""
        mx.eval([self.pool.data(self.tables[g].blocks[i]) for g, i in written])
        for g, i in written:
            table = self.tables[g]
            if self.pool.num_tokens(table.blocks[i]) == self.pool.page_size:
                parent = self._parent(g, i)
                h, extras = None, ()
                if self.spans:
                    P = self.pool.page_size
                    extras = page_extras(self.spans, i * P, P)
                    h = page_hash(parent, self.tokens[i * P : (i + 1) * P], extras)
                table.blocks[i] = self.pool.seal(table.blocks[i], parent, h, extras)

    def _parent(self, g: int, index: int) -> bytes:
        if index == 0:
            return self.pool.roots[g]
        chain = self._chains[g]
        if len(chain) < index:
            self._chains[g] = chain = chain_hashes(
                self.pool.roots[g], self.tokens[: index * self.pool.page_size],
                self.pool.page_size, start=chain, spans=self.spans)
        return chain[index - 1]

    def can_trim_to(self, length: int) -> bool:
        """Whether the cache can go back to its first ``length`` positions (a recurrent state
        cannot go back; a sliding window only as far as its buffer reaches)."""
        if length >= len(self.tokens):
            return True
        if self.state_layers:
            return False
        return all(layer.can_trim_to(length) for layer in self.paged_layers)

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens: their positions, token ids and pages."""
        self.sync()
        n = min(n, self.offset)
        if n and not self.can_trim_to(self.offset - n):
            raise ValueError(f"this sequence cannot drop its last {n} positions")
        for layer in self.paged_layers:
            layer.trim(n)
        self.sync()
        return n

    def sync(self) -> None:
        """Follow what mlx-lm's ``trim_prompt_cache`` did to the layers (it trims each layer
        cache alone): drop the token ids and pages past their length. Done by every step of the
        sequence (``prepare``, ``append_tokens``, ``commit``, ``trim``); call it to read the
        sequence right after trimming its layers."""
        if not self.paged_layers or self.paged_layers[0].offset >= len(self.tokens):
            return  # NOTE: no trim since the last step (the decode path: one comparison)
        offsets = {layer.offset for layer in self.paged_layers}
        assert len(offsets) == 1, f"layers disagree on the cache length: {sorted(offsets)}"
        end = offsets.pop()
        if end < len(self.tokens):
            del self.tokens[end:]
            if any(t.num_tokens > end for t in self.tables):  # a failed commit's groups too
                for t in self.tables:
                    for b in t.truncate(end) if t.num_tokens > end else ():
                        if b is not None:
                            self.pool.release(b)
                self.committed = min(self.committed, end)
                keep = end // self.pool.page_size
                self._chains = [c[:keep] for c in self._chains]

    # -- sharing --------------------------------------------------------------------------------

    def state_snapshot(self) -> Snapshot | None:
        """Copies of the recurrent state after the current tokens (None without such layers)."""
        if not self.state_layers:
            return None
        return copy_snapshot([list(c.cache) for c in self.state_layers])

    def fork(self) -> "PagedSequence":
        """A branch that shares every page and the prefix view (metadata is copied, data is
        not)."""
        self.commit()
        child = PagedSequence(self.pool, self.tokens, [t.blocks for t in self.tables],
                              self.state_snapshot(), self.views, self.spans)
        for mine, theirs in zip(self.paged_layers, child.paged_layers):
            if isinstance(mine, ChannelKeysCache):  # the open page's float keys
                theirs.tail = mine.float_tail()
        return child

    def share_prefix(self) -> None:
        """Make every full page of this sequence readable through one prefix view (before
        forking siblings that decode together): they then share it instead of each gathering
        the pages into its own buffers."""
        if self.views is None:
            return
        self.commit()
        view, c = self.views.acquire([t.blocks for t in self.tables], len(self.tokens))
        if view is not None:
            self.adopt(view)
            self.views.release(view)

    branch = fork

    def prefix_blocks(self, n_tokens: int) -> list[int | None]:
        """Group 0's blocks that hold the first ``n_tokens`` tokens (committed)."""
        return self.prefix_tables(n_tokens)[0]

    def prefix_tables(self, n_tokens: int) -> list[list[int | None]]:
        """Per group, the blocks that hold the first ``n_tokens`` tokens (committed); None for
        the pages a sliding window at ``n_tokens`` does not read."""
        if n_tokens > self.committed:
            raise ValueError(f"only {self.committed} tokens are in pages, {n_tokens} asked")
        P = self.pool.page_size
        return [g.kind.cut(t.blocks, n_tokens, P) for t, g in zip(self.tables, self.pool.groups)]

    def memory_report(self) -> MemoryReport:
        own, shared, divergence = 0, 0, None
        for t in self.tables:
            for i, b in enumerate(t.blocks):
                if b is None:
                    continue
                if self.pool.ref_count(b) > 1:
                    shared += self.pool.block_bytes(b)
                else:
                    own += self.pool.block_bytes(b)
                    at = i * self.pool.page_size
                    divergence = at if divergence is None else min(divergence, at)
        working = sum(layer.nbytes for layer in self.paged_layers) \
            + sum(c.nbytes for c in self.state_layers)
        return MemoryReport(
            length=len(self.tokens),
            own_bytes=own,
            shared_bytes=shared,
            working_bytes=working,
            divergence_point=len(self.tokens) if divergence is None else divergence,
        )

    def close(self) -> None:
        """Drop every hold and buffer. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for t in self.tables:
            self.pool.release_all(t.free_all())
        for layer in self.paged_layers:
            layer.drop_buffer()
            layer.offset = 0
        if self.views is not None:
            if self.view is not None:
                self.views.release(self.view)
            self._use_view(None, 0)
        for c in self.state_layers:
            c.cache = [None] * len(c.cache)
        self.points.clear()
        self.tokens.clear()
        self.committed = 0

    def __enter__(self) -> "PagedSequence":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

