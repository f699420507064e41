"""A sequence: its token ids, one page table per cache group, recurrent-state layers, and one
mlx-lm cache object per cache slot of the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from kv_cache.pages.hashing import chain_hashes
from kv_cache.model.layer_cache import PagedLayerCache, PagedWindowCache
from kv_cache.pages.pool import PagePool
from kv_cache.pages.block_table import PageTable
from kv_cache.model.spec import SLIDING
from kv_cache.model.state_points import StatePoints
from kv_cache.tokens import token_list

if TYPE_CHECKING:
    from kv_cache.model.attention import PrefixView, PrefixViews

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
    """One conversation's cache: pass ``seq.layers`` as the ``cache`` of an mlx-lm model.

    After a forward pass over token ids, call ``append_tokens(ids)``; ``commit()`` copies the new
    positions into pages (open tail page written in place when the sequence alone holds it, copied
    first otherwise; full pages sealed and deduplicated; pages a sliding window no longer reads
    released). ``close()`` drops every hold.
    """

    def __init__(self, pool: PagePool, tokens: Sequence[int] = (),
                 blocks: Sequence[int] | Sequence[Sequence[int | None]] = (),
                 state: Snapshot | None = None, views: PrefixViews | None = None):
        """Start from ``tokens`` whose keys and values the pool already holds: ``blocks`` per
        cache group (a plain list for a one-group pool; None where a sliding window no longer
        reads a page), and ``state``, the recurrent state after ``tokens`` (a reused prefix; the
        sequence takes its own holds and copies). With ``views``, the full-attention layers read
        the leading pages through a shared prefix view (``kv_cache.model.attention``) and keep only
        the rest in their buffers."""
        self.pool = pool
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
            cls = [PagedWindowCache(self, i, g.window, n) if g.kind == SLIDING
                   else PagedLayerCache(self, i, n) for i in g.layers]
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
        if views is not None:
            self.view, self.view_len = views.acquire([t.blocks for t in self.tables], n)
            views.attach(self)

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
        for g in view.groups:
            for layer in self.group_layers[g]:
                if layer.keys is not None:
                    cut = c - layer.base
                    layer.keys = mx.contiguous(layer.keys[..., cut:, :])
                    layer.values = mx.contiguous(layer.values[..., cut:, :])
                    layer.base = c
        if self.view is not None:
            self.views.release(self.view)
        view.users += 1
        self.view, self.view_len = view, c

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

    def append_tokens(self, ids: Sequence[int]) -> None:
        """Record the token ids of the positions the last forward pass added."""
        self._sync_trim()
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
        for table, layers in zip(self.tables, self.group_layers):
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
            for layer, (keys, values) in zip(layers, gathered):
                layer.load(keys, values, base)

    def drop_buffers(self) -> None:
        """Free the working buffers (after a commit); the next forward pass gathers again."""
        self.commit()
        for layer in self.paged_layers:
            layer.drop_buffer()

    def commit(self) -> None:
        """Copy every position not yet in pages into pages; release the pages that a sliding
        window no longer reads."""
        self._sync_trim()
        start, end = self.committed, self.offset
        assert len(self.tokens) == end, f"{len(self.tokens)} token ids for {end} positions"
        if end == start:
            return
        written: list[tuple[int, int]] = []
        for g in range(len(self.tables)):
            written += [(g, i) for i in self._write_group(g, start, end)]
        self.committed = end
        mx.eval([self.pool.data(self.tables[g].blocks[i]) for g, i in written])
        P = self.pool.page_size
        for g, i in written:
            table = self.tables[g]
            if self.pool.num_tokens(table.blocks[i]) == P:
                table.blocks[i] = self.pool.seal(table.blocks[i], self._parent(g, i))
        for g, layers in enumerate(self.group_layers):
            if layers[0].window:  # a window's pages behind it (a prefix view's stay held)
                self._release_before(g, layers[0].keep_from(end))

    def _write_group(self, g: int, start: int, end: int) -> list[int]:
        P, pool, table, layers = self.pool.page_size, self.pool, self.tables[g], self.group_layers[g]
        if isinstance(layers[0], PagedWindowCache):
            lo = layers[0].keep_from(end)
            if lo > start:
                # Positions before the window's start at ``end`` are never read again: no pages.
                self._release_before(g, lo)
                table.blocks.extend([None] * (lo // P - len(table.blocks)))
                table.num_tokens = start = lo
            else:
                # A page the window reads was released before a trim brought it back into the
                # window: write it again from the buffer (sealing finds the same page if cached).
                missing = next((i for i in range(lo // P, len(table.blocks))
                                if table.blocks[i] is None), None)
                if missing is not None:
                    for b in table.truncate(missing * P):
                        if b is not None:
                            pool.release(b)
                    start = missing * P
        kv = mx.stack([mx.stack(parts) for parts in
                       zip(*(layer.positions(start, end) for layer in layers))], axis=1)
        if start % P and not pool.is_writable(table.blocks[-1], start % P):
            # NOTE: copy-on-write: the tail page is shared, sealed or longer than our view.
            copy = pool.copy(table.blocks[-1], start % P)
            pool.release(table.blocks[-1])
            table.blocks[-1] = copy
        new_blocks = pool.allocate(table.blocks_needed(end - start), g)
        pos, written = start, []
        if start % P:  # the open tail page, ours alone now
            idx, at = len(table.blocks) - 1, start % P
            take = min(P - at, end - start)
            pool.write(table.blocks[idx], _page_slice(kv, 0, take), self.tokens[pos : pos + take])
            written.append(idx)
            pos += take
        first_new = len(table.blocks)
        table.blocks.extend(new_blocks)
        for j, block in enumerate(new_blocks):
            take = min(P, end - pos)
            pool.write(block, _page_slice(kv, pos - start, pos - start + take),
                       self.tokens[pos : pos + take])
            written.append(first_new + j)
            pos += take
        table.num_tokens = end
        return written

    def _release_before(self, g: int, position: int) -> None:
        """Release group ``g``'s pages that end at or before ``position``."""
        blocks = self.tables[g].blocks
        for i in range(min(position // self.pool.page_size, len(blocks))):
            if blocks[i] is not None:
                self.pool.release(blocks[i])
                blocks[i] = None

    def _parent(self, g: int, index: int) -> bytes:
        if index == 0:
            return self.pool.roots[g]
        chain = self._chains[g]
        if len(chain) < index:
            self._chains[g] = chain = chain_hashes(
                self.pool.roots[g], self.tokens[: index * self.pool.page_size],
                self.pool.page_size, start=chain)
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
        n = min(n, self.offset)
        if n and not self.can_trim_to(self.offset - n):
            raise ValueError(f"this sequence cannot drop its last {n} positions")
        for layer in self.paged_layers:
            layer.trim(n)
        self._sync_trim()
        return n

    def _sync_trim(self) -> None:
        # mlx-lm's trim_prompt_cache trims each layer; follow it here.
        if not self.paged_layers:
            return
        offsets = {layer.offset for layer in self.paged_layers}
        assert len(offsets) == 1, f"layers disagree on the cache length: {sorted(offsets)}"
        end = offsets.pop()
        if end < len(self.tokens):
            del self.tokens[end:]
            if end < self.committed:
                for t in self.tables:
                    for b in t.truncate(end):
                        if b is not None:
                            self.pool.release(b)
                self.committed = end
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
        return PagedSequence(self.pool, self.tokens, [t.blocks for t in self.tables],
                             self.state_snapshot(), self.views)

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
        P, out = self.pool.page_size, []
        for table, g in zip(self.tables, self.pool.groups):
            blocks = table.blocks[: -(-n_tokens // P)]
            skip = g.first_needed(n_tokens) // P
            out.append([None] * skip + blocks[skip:])
        return out

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
            self.views.detach(self)
            if self.view is not None:
                self.views.release(self.view)
            self.view, self.view_len = None, 0
        for c in self.state_layers:
            c.cache = [None] * len(c.cache)
        self.points.clear()
        self.tokens.clear()
        self.committed = 0

    def __enter__(self) -> "PagedSequence":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _page_slice(kv: mx.array, a: int, b: int) -> mx.array:
    return kv if (a == 0 and b == kv.shape[3]) else mx.contiguous(kv[:, :, :, a:b, :])
