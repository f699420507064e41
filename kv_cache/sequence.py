"""A sequence: its token ids, its page table in the pool, and one mlx-lm cache per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from .layer_cache import PagedLayerCache
from .page_pool import PagePool
from .page_table import PageTable


@dataclass(frozen=True, slots=True)
class MemoryReport:
    length: int  # tokens
    own_bytes: int  # pages this sequence alone holds
    shared_bytes: int  # pages held by someone else too
    working_bytes: int  # contiguous working buffers while the sequence runs
    divergence_point: int  # first token position on a page this sequence alone holds

    @property
    def total_bytes(self) -> int:
        return self.own_bytes + self.shared_bytes


class PagedSequence:
    """One conversation's cache: pass ``seq.layers`` as the ``cache`` of an mlx-lm model.

    After a forward pass over token ids, call ``append_tokens(ids)``; ``commit()`` copies the new
    positions into pages (open tail page written in place when the sequence alone holds it, copied
    first otherwise; full pages sealed and deduplicated). ``close()`` drops every hold.
    """

    def __init__(self, pool: PagePool, tokens: Sequence[int] = (), blocks: Sequence[int] = ()):
        """Start from ``tokens`` whose keys and values the pool already holds in ``blocks``
        (a reused prefix; the sequence takes its own holds)."""
        self.pool = pool
        self.table = PageTable(pool.page_size, list(blocks), len(tokens))
        for b in self.table.blocks:
            pool.hold(b)
        self.tokens: list[int] = [int(t) for t in tokens]
        self.committed = len(self.tokens)
        self.layers = [PagedLayerCache(self, i, len(self.tokens)) for i in range(pool.num_layers)]
        self.closed = False

    @property
    def offset(self) -> int:
        return self.layers[0].offset

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

    def materialize(self) -> None:
        """Gather the committed prefix from the pages into every layer's working buffer."""
        if self.committed == 0:
            return
        step = PagedLayerCache.step
        room = -(-(self.committed + 1) // step) * step - self.committed
        gathered = self.pool.gather_layers(self.table.blocks, self.committed, room)
        for layer, (keys, values) in zip(self.layers, gathered):
            layer.load(keys, values)

    def drop_buffers(self) -> None:
        """Free the working buffers (after a commit); the next forward pass gathers again."""
        self.commit()
        for layer in self.layers:
            layer.drop_buffer()

    def commit(self) -> None:
        """Copy every position not yet in pages into pages (all pages allocated up front)."""
        self._sync_trim()
        start, end = self.committed, self.offset
        assert len(self.tokens) == end, f"{len(self.tokens)} token ids for {end} positions"
        if end == start:
            return
        P, pool, table = self.pool.page_size, self.pool, self.table
        kv = mx.stack(
            [
                mx.stack([layer.keys[0, :, start:end, :] for layer in self.layers]),
                mx.stack([layer.values[0, :, start:end, :] for layer in self.layers]),
            ],
            axis=1,
        )
        if start % P and not pool.is_writable(table.blocks[-1], start % P):
            # NOTE: copy-on-write: the tail page is shared, sealed or longer than our view.
            copy = pool.copy(table.blocks[-1], start % P)
            pool.release(table.blocks[-1])
            table.blocks[-1] = copy
        new_blocks = pool.allocate(table.blocks_needed(end - start))
        pos, written = start, []
        if start % P:  # the open tail page, ours alone now
            idx, at = len(table.blocks) - 1, start % P
            block = table.blocks[idx]
            take = min(P - at, end - start)
            pool.write(block, _page_slice(kv, 0, take), self.tokens[pos : pos + take])
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
        self.committed = end
        mx.eval([pool.data(table.blocks[i]) for i in written])
        for i in written:
            if pool.num_tokens(table.blocks[i]) == P:
                table.blocks[i] = pool.seal(table.blocks[i], pool.parent_hash(table.blocks, i))

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens: their positions, token ids and pages."""
        n = min(n, self.offset)
        for layer in self.layers:
            layer.trim(n)
        self._sync_trim()
        return n

    def _sync_trim(self) -> None:
        # mlx-lm's trim_prompt_cache trims each layer; follow it here.
        offsets = {layer.offset for layer in self.layers}
        assert len(offsets) == 1, f"layers disagree on the cache length: {sorted(offsets)}"
        end = offsets.pop()
        if end < len(self.tokens):
            del self.tokens[end:]
            if end < self.committed:
                for b in self.table.truncate(end):
                    self.pool.release(b)
                self.committed = end

    # -- sharing --------------------------------------------------------------------------------

    def fork(self) -> "PagedSequence":
        """A branch that shares every page (metadata is copied, data is not)."""
        self.commit()
        return PagedSequence(self.pool, self.tokens, self.table.blocks)

    branch = fork

    def prefix_blocks(self, n_tokens: int) -> list[int]:
        """The blocks that hold the first ``n_tokens`` tokens (committed)."""
        if n_tokens > self.committed:
            raise ValueError(f"only {self.committed} tokens are in pages, {n_tokens} asked")
        return self.table.blocks[: -(-n_tokens // self.pool.page_size)]

    def memory_report(self) -> MemoryReport:
        pb, own, shared, divergence = self.pool.page_bytes, 0, 0, None
        for i, b in enumerate(self.table.blocks):
            if self.pool.ref_count(b) > 1:
                shared += pb
            else:
                own += pb
                if divergence is None:
                    divergence = i * self.pool.page_size
        return MemoryReport(
            length=len(self.tokens),
            own_bytes=own,
            shared_bytes=shared,
            working_bytes=sum(layer.nbytes for layer in self.layers),
            divergence_point=len(self.tokens) if divergence is None else divergence,
        )

    def close(self) -> None:
        """Drop every hold and buffer. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for b in self.table.free_all():
            self.pool.release(b)
        for layer in self.layers:
            layer.drop_buffer()
            layer.offset = 0
        self.tokens.clear()
        self.committed = 0

    def __enter__(self) -> "PagedSequence":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _page_slice(kv: mx.array, a: int, b: int) -> mx.array:
    return kv if (a == 0 and b == kv.shape[3]) else mx.contiguous(kv[:, :, :, a:b, :])
