"""State points: recurrent-state snapshots at a prompt's message boundaries.

A recurrent state (``ArraysCache``: conv, SSM, gated-delta) cannot be rewound, so a model with
one resumes only where a snapshot of it exists. Entries end where a turn's prompt or answer
ends; a history that changes inside (an edited earlier message, a template that renders an
earlier answer otherwise) would fall back to the entry before the change, often far back.

So while a prompt runs, its state is also snapshotted at message boundaries: the positions
right after each end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, the tokenizer's end ids:
:func:`boundaries`, one pass over the ids, whatever the template). A prompt snapshots at most
:data:`K` of them (:func:`choose`: its first boundary, where a shared system prompt ends, and
its last ``K - 1``), each after the reused prefix; the runner stops a prompt piece exactly at
each (:meth:`StatePoints.stop`), and the sequence takes the snapshot when it gets there
(:meth:`StatePoints.reached`).

Each snapshot is saved as an entry of its own, keyed by its content (:func:`point_keys`: a hash
of the token ids before it, behind a control character no client id holds): the pages it uses
are the turn's own (held, not copied), the same boundary reached again by a later turn or
another conversation is the same entry (kept once, in memory and on disk), and the disk store
counts, evicts and finds it like any entry (by key, and by where it ends). A later prompt looks
its own boundaries up by key, longest first: one that agrees up to boundary b and differs after
it resumes from b. The stored tokens decide, as for every entry (invariant 3).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from typing import Callable, Iterable, Sequence

import mlx.core as mx

from kv_cache.layout.spec import CacheSpec

K = 8  # snapshots a prompt takes at most (its first boundary and its last K - 1)
PREFIX = "\x00state:"  # NOTE: client message ids hold no control character (invariant 7)
_STEP = 4096  # token ids hashed per update


def boundaries(prompt: Sequence[int], end_ids: Iterable[int]) -> list[int]:
    """The positions of ``prompt`` right after each end-of-turn token (``end_ids``), in order,
    from 1 to ``len(prompt) - 1`` (the prompt's own end is not a boundary: its entry is)."""
    ends = frozenset(int(i) for i in end_ids)
    if not ends:
        return []
    return [i + 1 for i, t in enumerate(prompt[:-1]) if t in ends]


def choose(points: Sequence[int], start: int, end: int, k: int = K) -> list[int]:
    """Where a prompt that runs from ``start`` to ``end`` snapshots its state: of its boundaries
    ``points`` strictly between, the first (a shared system prompt's end) and the last
    ``k - 1``."""
    inside = [p for p in points if start < p < end]
    if len(inside) <= k:
        return inside
    return inside[:1] + inside[len(inside) - (k - 1):] if k > 1 else inside[-k:]


def point_keys(tokens: Sequence[int], positions: Sequence[int]) -> list[str]:
    """The entry key of the state after ``tokens[:p]``, for each of ``positions`` (ascending);
    one pass over the ids."""
    h, done, out = hashlib.sha256(), 0, []
    for p in positions:
        while done < p:
            step = min(p, done + _STEP)
            h.update(array("q", tokens[done:step]).tobytes())
            done = step
        out.append(PREFIX + h.copy().hexdigest())
    return out


def is_point(key: str) -> bool:
    return key.startswith(PREFIX)


def snapshot_bytes(spec: CacheSpec) -> int:
    """What one state snapshot of a model with ``spec`` holds: every state slot's arrays."""
    return sum(math.prod(shape) * getattr(mx, dt).size
               for s in spec.states for shape, dt in zip(s.shapes, s.dtypes))


class StatePoints:
    """A running sequence's planned snapshot positions and the snapshots it took there."""

    __slots__ = ("planned", "taken")

    def __init__(self) -> None:
        self.planned: list[int] = []  # ascending
        self.taken: list[tuple[int, list]] = []  # (position, snapshot)

    def plan(self, positions: Sequence[int]) -> None:
        self.planned = sorted(set(positions))

    def stop(self, done: int, end: int) -> int:
        """Where a prompt piece from ``done`` that would run to ``end`` must stop: the first
        planned position in between, else ``end``."""
        return next((p for p in self.planned if done < p < end), end)

    def reached(self, length: int, snapshot: Callable[[], list | None]) -> None:
        """The sequence now holds ``length`` positions: snapshot its state if planned there."""
        if self.planned and length in self.planned:
            snap = snapshot()
            if snap is not None:
                mx.eval(snap)  # NOTE: a copy of the state now, not a graph kept alive
                self.taken.append((length, snap))
        if self.planned and length >= self.planned[-1]:
            self.planned = []

    def take(self, upto: int) -> list[tuple[int, list]]:
        """The snapshots taken at or before ``upto``, handed over once."""
        out = [(p, s) for p, s in self.taken if p <= upto]
        self.taken = [(p, s) for p, s in self.taken if p > upto]
        return out

    def clear(self) -> None:
        self.planned, self.taken = [], []

