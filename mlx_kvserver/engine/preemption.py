"""Giving up running answers to make room: a part of ``Scheduler`` (``scheduler.py``).

The page pool never calls up (``kv_cache``: out of pages is an ``OutOfBlocksError``); the
scheduler asks the manager for room first (``with_room``), lets the prepared next turns go, and
only then preempts the youngest other running answer. The memory budget (``pressure.py``) uses
the same preemption, saving the answer's pages under a key of its own first, so it goes on from
them later with the same answer.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kv_cache import OutOfBlocksError

from .pressure import preempted_key
from .request import Choice, Request

log = logging.getLogger("mlx_kvserver.engine")


class Preemption:
    """``self.manager``, ``self.decoding``, ``self.prepares``, ``self.speculation``,
    ``self.pressure``, ``self._save`` and ``self._guard`` are the scheduler's."""

    def _may_start(self, r: Request) -> bool:
        ok: list = []
        self._guard(r, lambda: ok.append(self.pressure.may_start(r)))
        return bool(ok and ok[0])

    def _with_room(self, r: Request, fn: Callable[[], Any]) -> bool:
        """Run ``fn``, which takes pages, with the room the manager can make; when that is not
        enough, preempt the youngest other running choice and try again. False when nothing else runs and they still do not suffice (the
        caller goes on without caching: running sequences keep their positions in their own
        buffers, so a request never needs pages to be answered)."""
        while True:
            try:
                self.manager.with_room(fn)
                return True
            except OutOfBlocksError:
                if self.prepares:  # prepared next turns give way first
                    self.prepares.clear()
                    continue
                victim = self._youngest(other_than=r)
                if victim is None:
                    return False
                self._preempt(victim)

    def _start(self, r: Request, tokens: list[int], keys: list[str], boundaries=()):
        """``manager.start`` with room made for what it loads; uncached when there is none."""
        out: list = []
        if r.use_cache and self._with_room(r, lambda: out.append(
                self.manager.start(tokens, keys, use_cache=True, boundaries=boundaries))):
            return out[0]
        r.use_cache = False
        return self.manager.start(tokens, keys, use_cache=False)

    def _youngest(self, other_than: Request | None = None) -> Choice | None:
        running = [c for c in self.decoding if c.request is not other_than and c.seq is not None]
        return max(running, key=lambda c: (c.request.arrival, c.index), default=None)

    youngest_running = _youngest

    def preempt(self, c: Choice, save: bool = False) -> None:
        """Close ``c``'s sequence; it goes on from its tokens when its turn comes again: from
        its saved pages (``save``: kept under a key of its own, on disk too), else recomputed
        where the cache no longer holds them."""
        log.info("%s: choice %d preempted (%s)", c.request.id, c.index,
                 "memory short: its pages are saved" if save else "pages ran out")
        self.decoding.remove(c)
        self.speculation.release(c)
        c.resume, c.resume_done = list(c.seq.tokens), 0
        if save and c.request.use_cache:
            c.resume_keys = [preempted_key(c.message_id)]
            self._save(c.resume_keys[0], c.seq)
        c.seq.close()
        c.seq = None

    _preempt = preempt
