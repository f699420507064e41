"""The engine's memory policy: what the budget (``memory.py``) and the page pool allow, as
decisions the scheduler acts on (:class:`Pressure`, :func:`give_way`). Nothing here holds the
scheduler or changes its state: each question is answered from the facts it is given.

- Admission (``admit``): a request that cannot fit even alone (the weights, its working buffers
  at its full length, one small pass at that context) is refused at once with a 400 that says
  the figures; an answer that could not fit whole is capped where memory ends.
- A new prompt (``may_start``) starts when its first pass and its buffers fit beside the prompts
  already started; else it waits, without a time limit, as the answers running ahead of it free
  their memory as they finish (``backlog.py`` counts what waits; the log says once why). A new
  prompt never preempts a running answer.
- Before each pass: will what MLX holds now plus the pass's estimated peak fit the limit (for
  a chunk that reaches an image read afresh, the vision encoder's pass over it too)? A
  prompt's chunk is cut down until it does (``chunk``, to ``MIN_CHUNK`` tokens); a decode step
  verifies no drafts before it gives up anything else (``width``), and only then are the newest
  running answers preempted, one at a time (``victims``): the scheduler saves each one's pages
  under a key of its own (``preempted_key``), and it goes on later from them with the same
  answer (greedy, or from its sampler's own key).
- When a pass would not fit, what nothing running needs is given back first (``relieve``): MLX's
  buffer cache, then each model's idle work and cache (the budget's shedders: the prepared next
  turns, image features kept in memory, resident sequences' buffers, entries the disk holds,
  cached pages nothing holds), and the C heap.
- Out of pages (``give_way``): the page pool never calls up (``kv_cache``: out of pages is an
  ``OutOfBlocksError``); when the manager cannot make room itself (``with_room``), the prepared
  next turns give way, then the newest other running answer (recomputed later from its tokens;
  with the cache its prompt is found again in pages or on disk), else nothing: the request goes
  on uncached (a running sequence keeps its positions in its own buffers).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import mlx.core as mx

from ..errors import RequestError
from .memory import GB, MemoryBudget, give_back

log = logging.getLogger("mlx_kvserver.engine")

MIN_CHUNK = 16  # the smallest prompt chunk a pass is cut down to
TRIM_EVERY_S = 1.0  # the C heap trimmed under pressure at most this often (it walks arenas)


def preempted_key(message_id: str) -> str:
    """The entry key a preempted answer's pages are saved under (a control character keeps it
    apart from every client id)."""
    return f"\x00preempted:{message_id}"


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB"


def newest(running: Sequence[Any], other_than: Any = None) -> Any:
    """The newest running choice (the latest request's last choice) that holds a sequence, not
    of the request ``other_than``; None when there is none."""
    live = [c for c in running if c.request is not other_than and c.seq is not None]
    return max(live, key=lambda c: (c.request.arrival, c.index), default=None)


@dataclass(frozen=True)
class GiveWay:
    """What gives way when the page pool is full: the prepared next turns (``prepared``), else
    a running answer to preempt (``preempt``); neither: nothing, and the request goes on
    uncached."""

    prepared: bool = False
    preempt: Any = None


def give_way(prepared: bool, running: Sequence[Any], request: Any) -> GiveWay:
    """What gives way for ``request`` when the manager could not make room: the prepared next
    turns where there are any (``prepared``), else the newest other answer of ``running``."""
    if prepared:
        return GiveWay(prepared=True)
    return GiveWay(preempt=newest(running, other_than=request))


class Pressure:
    """The memory budget's decisions for one model (``name``) of the server's ``memory``."""

    def __init__(self, memory: MemoryBudget, name: str = "model") -> None:
        self.memory, self.name = memory, name
        self.logged = 0.0  # when relieve() last logged
        self.trimmed = float("-inf")  # when the C heap was last trimmed (``give_back``)

    def admit(self, r) -> int:
        """The answer tokens ``r`` may have: its ``max_tokens``, or fewer where an answer that
        long could not fit (capped where memory ends, as at the context's end: it finishes with
        ``length``; ``max_tokens`` is a cap, not a reservation). A ``RequestError`` 400, with
        the figures, when its prompt cannot fit even alone."""
        m = self.memory
        room = m.limit - m.weights_total - m.outside - m.margin  # what requests may ever hold

        def need(answer: int) -> int:
            return m.request_floor(self.name, len(r.prompt), answer)

        if need(r.max_tokens) <= room:
            return r.max_tokens
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
        return lo

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

    def may_start(self, r, started: Sequence[Any], running: int) -> bool:
        """Whether ``r``'s prompt may start now (its first pass and its buffers fit), beside the
        prompts ``started`` and not finished and ``running`` answers. When not, it waits for
        them: they free their memory as they finish (no time limit: they make progress); the
        first time (``r.waiting_for`` not yet "memory"), the log says why."""
        m = self.memory
        need = m.request_floor(self.name, len(r.prompt), r.max_tokens)
        # NOTE: prompts already started grow to their own floors: counted whole (what they hold
        # now is counted twice, erring on the safe side), so four long prompts sent at once
        # start one after another under a tight limit instead of all together
        ahead = sum(m.request_floor(self.name, len(o.prompt), o.max_tokens) for o in started)
        if self.fits(need + ahead):
            return True
        self.relieve()
        if self.fits(need + ahead) or not (running or started):
            return True  # nothing else runs: it fits alone (admission said so)
        if r.waiting_for != "memory":
            log.info("%s waits for memory: it needs about %s (%d prompt tokens, up to %d "
                     "answer tokens) beside %s in use of %s (--memory-limit), while %d answers "
                     "and %d prompts run ahead of it (%s committed to them)", r.id, _gb(need),
                     len(r.prompt), r.max_tokens, _gb(m.in_use()), _gb(m.limit),
                     running, len(started), _gb(ahead))
        return False

    def chunk(self, done: int, want: int, first: bool = False,
              images: Sequence[tuple[int, int, int]] = ()) -> int:
        """How many of the ``want`` next prompt tokens of a prompt (``done`` read) one pass may
        read: ``want``, or fewer where the pass would not fit; 0 when not even ``MIN_CHUNK``
        fits after giving back what nothing running needs, unless ``first`` (the oldest prompt
        and no answer running): that one goes on with the small chunk, as admission said it fits
        alone and MLX's limit is the guard (waiting would wait for nothing: a spin).
        ``images``: ``(start, end, patches)`` of the prompt's images whose features must be
        computed (not kept): a pass that reaches one runs the vision encoder over it too
        (``encoder_peak``, counted for any chunk that reaches into the image)."""
        m = self.memory

        def peak(c: int) -> int:
            return m.pass_peak(self.name, c, done) + sum(
                m.encoder_peak(self.name, p) for start, end, p in images
                if start < done + c and end > done)
        c = want
        while c > MIN_CHUNK and not self.fits(peak(c)):
            c //= 2
        if self.fits(peak(c)):
            return c
        self.relieve()
        return c if first or self.fits(peak(c)) else 0

    def width(self, rows: int, width: int, context: int) -> tuple[int, bool]:
        """The widest decode step (``width`` positions a row, down to 1) of ``rows`` rows at
        ``context`` that fits, and whether it does: when not even one position a row fits,
        what nothing running needs is given back first, and answers must give way
        (``victims``) where it still does not."""
        peak = self.memory.pass_peak
        w = width
        while w > 1 and not self.fits(peak(self.name, w, context, rows)):
            w = 1 if w <= 2 else w // 2
        if self.fits(peak(self.name, w, context, rows)):
            return w, True
        self.relieve()
        return w, False

    def victims(self, running: Sequence[Any], rows: int, width: int,
                context: int) -> Iterator[Any]:
        """The running answers to preempt (their pages saved) until a step of ``rows`` rows
        ``width`` wide fits: the newest first, one at a time, each given up by the caller before
        the next is asked for (a preempted answer frees its buffers); never the last one (one
        answer alone: admission said it fits; MLX's limit is the guard)."""
        peak = self.memory.pass_peak
        left = list(running)
        while not self.fits(peak(self.name, width, context, rows)):
            victim = newest(left)
            if victim is None or len(left) <= 1:
                return
            left.remove(victim)
            yield victim
            rows -= 1

    def relieve(self) -> None:
        """Give back what nothing running needs: MLX's buffer cache, each model's prepared next
        turns and cache (the budget's shedders: resident buffers, entries on disk, unheld
        pages) and the C heap."""
        self.memory.pressure_events += 1
        before = self.memory.in_use()
        mx.clear_cache()
        pages = self.memory.shed()
        self.give_back()
        now = time.monotonic()
        if now - self.logged >= 1.0:  # at most once a second (a waiting prompt asks each step)
            self.logged = now
            log.info("%s: memory short (%s in use, limit %s): gave back %s (%d pages)",
                     self.name, _gb(before), _gb(self.memory.limit),
                     _gb(max(0, before - self.memory.in_use())), pages)
