"""What a scheduler does about its memory budget (``memory.py``): :class:`Pressure`.

- Admission: a request that cannot fit even alone (the weights, its working buffers at its full
  length, one small pass at that context) is refused at once with a 400 that says the figures.
- Before each pass: will what MLX holds now plus the pass's estimated peak fit the limit? A
  prompt's chunk is cut down until it does (to ``MIN_CHUNK`` tokens); a decode step verifies no
  drafts before it gives up anything else.
- When it would not fit, in order: MLX's buffer cache is freed; the prepared next turns go; each
  model's cache gives back what nothing running needs (resident sequences' buffers, entries the
  disk holds, cached pages nothing holds: ``CacheManager.shed``); then the newest running answer
  is preempted: its pages are saved under a key of its own, and it goes on later from them with
  the same answer (greedy, or from its sampler's own key). A new prompt never preempts a running
  answer: it waits, and after ``WAIT_S`` it is answered 503 with ``Retry-After``.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx

from ..errors import RequestError
from .memory import GB

log = logging.getLogger("mlx_kvserver.engine")

MIN_CHUNK = 16  # the smallest prompt chunk a pass is cut down to
WAIT_S = 60.0  # how long a prompt waits for memory before its 503
RETRY_AFTER_S = 5


def preempted_key(message_id: str) -> str:
    """The entry key a preempted answer's pages are saved under (a control character keeps it
    apart from every client id)."""
    return f"\x00preempted:{message_id}"


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB"


class Pressure:
    """The memory side of one scheduler (``scheduler``: its requests, running choices and
    preemption; ``memory``: the server's ``MemoryBudget``)."""

    def __init__(self, scheduler, memory) -> None:
        self.s, self.memory = scheduler, memory
        self.logged = 0.0  # when relieve() last logged

    def admit(self, r) -> None:
        """Refuse ``r`` (400, with the figures) when it cannot fit even alone."""
        m = self.memory
        need = m.request_floor(self.s.name, len(r.prompt), r.max_tokens)
        if m.weights_total + m.outside + m.margin + need > m.limit:
            m.refused += 1
            raise RequestError(
                400, f"this request needs about {_gb(need)} of memory beyond the models' "
                f"weights ({_gb(m.weights_total)}) and the process's own "
                f"({_gb(m.outside + m.margin)}): "
                f"{len(r.prompt)} prompt tokens and up to "
                f"{r.max_tokens} answer tokens; the server's memory limit is {_gb(m.limit)} "
                "(--memory-limit). Shorten the conversation or ask for fewer tokens",
                param="max_tokens", code="insufficient_memory")

    def fits(self, extra: int) -> bool:
        """Whether ``extra`` more bytes fit the budget, MLX's buffer cache given back first
        where that makes the difference (it is counted as held: it is resident)."""
        if self.memory.in_use() + extra <= self.memory.limit:
            return True
        if not mx.get_cache_memory():
            return False
        mx.clear_cache()
        return self.memory.in_use() + extra <= self.memory.limit

    def chunk(self, r, done: int, want: int, first: bool = False) -> int:
        """How many of the ``want`` next prompt tokens of ``r`` (``done`` read) one pass may
        read: ``want``, or fewer where the pass would not fit; 0 when not even ``MIN_CHUNK``
        fits after giving back what nothing running needs, unless ``first`` (the oldest prompt
        and no answer running): that one goes on with the small chunk, as admission said it fits
        alone and MLX's limit is the guard (waiting would wait for nothing: a spin)."""
        peak = self.memory.pass_peak
        c = want
        while c > MIN_CHUNK and not self.fits(peak(self.s.name, c, done)):
            c //= 2
        if self.fits(peak(self.s.name, c, done)):
            return c
        self.relieve()
        return c if first or self.fits(peak(self.s.name, c, done)) else 0

    def step(self, rows: int, width: int, context: int) -> int:
        """The widest decode step (``width`` positions a row, down to 1) that fits, after giving
        back what nothing running needs and preempting the newest answers if it must; 0 when
        nothing may run (only where no answer is left to preempt)."""
        peak = self.memory.pass_peak
        w = width
        while w > 1 and not self.fits(peak(self.s.name, w, context, rows)):
            w = 1 if w <= 2 else w // 2
        if self.fits(peak(self.s.name, w, context, rows)):
            return w
        self.relieve()
        while not self.fits(peak(self.s.name, w, context, rows)):
            victim = self.s.youngest_running()
            if victim is None or len(self.s.decoding) <= 1:
                return w  # one answer alone: admission said it fits; MLX's limit is the guard
            self.s.preempt(victim, save=True)
            rows -= 1
        return w

    def relieve(self) -> None:
        """Give back what nothing running needs: MLX's buffer cache, the prepared next turns,
        the caches' resident buffers, entries on disk and unheld pages."""
        self.memory.pressure_events += 1
        before = self.memory.in_use()
        mx.clear_cache()
        self.s.prepares.clear()
        pages = self.memory.shed()
        mx.clear_cache()
        now = time.monotonic()
        if now - self.logged >= 1.0:  # at most once a second (a waiting prompt asks each step)
            self.logged = now
            log.info("%s: memory short (%s in use, limit %s): gave back %s (%d pages)",
                     self.s.name, _gb(before), _gb(self.memory.limit),
                     _gb(max(0, before - self.memory.in_use())), pages)

    def may_start(self, r) -> bool:
        """Whether ``r``'s prompt may start now (its first pass and its buffers fit); a prompt
        that waited ``WAIT_S`` without room is answered 503 with ``Retry-After``."""
        m = self.memory
        need = m.request_floor(self.s.name, len(r.prompt), r.max_tokens)
        # NOTE: prompts already started grow to their own floors: counted whole (what they hold
        # now is counted twice, erring on the safe side), so four long prompts sent at once
        # start one after another under a tight limit instead of all together
        started = [o for o in self.s.requests if o is not r and o.seq is not None]
        need += sum(m.request_floor(self.s.name, len(o.prompt), o.max_tokens) for o in started)
        if self.fits(need):
            return True
        self.relieve()
        if self.fits(need) or not (self.s.decoding or started):
            return True  # nothing else runs: it fits alone (admission said so)
        if r.waiting_since is None:
            r.waiting_since = time.monotonic()
        if time.monotonic() - r.waiting_since > WAIT_S:
            raise RequestError(503, f"the server's memory is taken by running answers "
                               f"({_gb(m.in_use())} of {_gb(m.limit)}); try again shortly",
                               type="server_error", code="memory_busy",
                               retry_after=RETRY_AFTER_S)
        return False
