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
  answer: it waits, without a time limit, as the answers running ahead of it free their memory
  as they finish (``backlog.py`` counts what waits; the log says once why each waits).
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx

from ..errors import RequestError
from .memory import GB, give_back

log = logging.getLogger("mlx_kvserver.engine")

MIN_CHUNK = 16  # the smallest prompt chunk a pass is cut down to
TRIM_EVERY_S = 1.0  # the C heap trimmed under pressure at most this often (it walks arenas)


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
        self.trimmed = float("-inf")  # when the C heap was last trimmed (``give_back``)

    def admit(self, r) -> None:
        """Refuse ``r`` (400, with the figures) when its prompt cannot fit even alone; an answer
        that could not fit whole is capped where memory ends (as at the context's end: it
        finishes with ``length``), ``max_tokens`` being a cap, not a reservation."""
        m = self.memory
        room = m.limit - m.weights_total - m.outside - m.margin  # what requests may ever hold

        def need(answer: int) -> int:
            return m.request_floor(self.s.name, len(r.prompt), answer)

        if need(r.max_tokens) <= room:
            return
        if need(1) > room:
            m.refused += 1
            raise RequestError(
                400, f"this prompt needs about {_gb(need(1))} of memory beyond the models' "
                f"weights ({_gb(m.weights_total)}) and the process's own "
                f"({_gb(m.outside + m.margin)}) for its {len(r.prompt)} tokens; the server's "
                f"memory limit is {_gb(m.limit)} (--memory-limit). Shorten the conversation",
                param=r.prompt_param, code="insufficient_memory")
        lo, hi = 1, r.max_tokens  # need(lo) fits, need(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= room else (lo, mid)
        log.info("%s: up to %d answer tokens (of %d asked) fit the memory limit beside its "
                 "%d prompt tokens (%s of %s for requests)", r.id, lo, r.max_tokens,
                 len(r.prompt), _gb(need(lo)), _gb(room))
        r.max_tokens = lo

    def fits(self, extra: int) -> bool:
        """Whether ``extra`` more bytes fit the budget, MLX's buffer cache given back first
        where that makes the difference (it is counted as held: it is resident)."""
        if self.memory.in_use() + extra <= self.memory.limit:
            return True
        if not mx.get_cache_memory():
            return False
        self.give_back()
        return self.memory.in_use() + extra <= self.memory.limit

    def give_back(self) -> None:
        """MLX's buffer cache back, the C heap trimmed too at most every ``TRIM_EVERY_S`` (a
        prompt waiting for memory asks each step)."""
        now = time.monotonic()
        trim = now - self.trimmed >= TRIM_EVERY_S
        if trim:
            self.trimmed = now
        give_back(trim)

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
        self.give_back()
        now = time.monotonic()
        if now - self.logged >= 1.0:  # at most once a second (a waiting prompt asks each step)
            self.logged = now
            log.info("%s: memory short (%s in use, limit %s): gave back %s (%d pages)",
                     self.s.name, _gb(before), _gb(self.memory.limit),
                     _gb(max(0, before - self.memory.in_use())), pages)

    def may_start(self, r) -> bool:
        """Whether ``r``'s prompt may start now (its first pass and its buffers fit). When not,
        it waits for the answers running ahead of it, which free their memory as they finish
        (no time limit: they make progress); the first time, the log says why."""
        m = self.memory
        need = m.request_floor(self.s.name, len(r.prompt), r.max_tokens)
        # NOTE: prompts already started grow to their own floors: counted whole (what they hold
        # now is counted twice, erring on the safe side), so four long prompts sent at once
        # start one after another under a tight limit instead of all together
        started = [o for o in self.s.requests if o is not r and o.seq is not None]
        ahead = sum(m.request_floor(self.s.name, len(o.prompt), o.max_tokens) for o in started)
        if self.fits(need + ahead):
            return True
        self.relieve()
        if self.fits(need + ahead) or not (self.s.decoding or started):
            return True  # nothing else runs: it fits alone (admission said so)
        if r.waiting_for != "memory":
            r.waiting_for = "memory"
            log.info("%s waits for memory: it needs about %s (%d prompt tokens, up to %d "
                     "answer tokens) beside %s in use of %s (--memory-limit), while %d answers "
                     "and %d prompts run ahead of it (%s committed to them)", r.id, _gb(need),
                     len(r.prompt), r.max_tokens, _gb(m.in_use()), _gb(m.limit),
                     len(self.s.decoding), len(started), _gb(ahead))
        return False
