"""The requests that wait to start: :class:`Backlog`.

A request is in the backlog from the moment the HTTP layer submits it until its prompt starts
(its ``Accepted`` event) or it ends without starting (an error, or its client hung up). While it
waits it keeps its place: there is no time limit, since the answers running ahead of it make
progress and free what it waits for (memory, a place in the batch). The one refusal here is a
backlog longer than ``--max-queue``: a 429 whose ``Retry-After`` is how long the backlog takes
to drain that far at the rate prompts started lately (vLLM and llama.cpp queue without a time
limit too; OpenAI's clients honour ``Retry-After``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from ..errors import RequestError

RATE_WINDOW = 64  # the last starts the drain rate is measured over
RETRY_UNMEASURED_S = 5  # Retry-After before any prompt has started (nothing measured yet)
RETRY_MAX_S = 3600


class Backlog:
    """Submitted requests whose prompt has not started, counted across threads (the HTTP
    layer enters, the engine thread leaves). ``limit``: the most that may wait (0: no limit)."""

    def __init__(self, limit: int, clock=time.monotonic) -> None:
        self.limit, self._clock = limit, clock
        self._lock = threading.Lock()
        self._jobs: dict[int, float] = {}  # id(job) -> when it entered
        self._starts: deque[float] = deque(maxlen=RATE_WINDOW)  # when prompts started
        self.refused = 0  # requests refused with a 429
        self.started = 0
        self.waited_s = 0.0  # the time started requests spent waiting, in all

    def __len__(self) -> int:
        return len(self._jobs)

    def enter(self, job) -> None:
        """Count ``job`` as waiting; a 429 with ``Retry-After`` when ``limit`` already wait."""
        with self._lock:
            if self.limit and len(self._jobs) >= self.limit:
                self.refused += 1
                retry = self.retry_after(len(self._jobs) - self.limit + 1)
                raise RequestError(
                    429, f"{len(self._jobs)} requests are waiting to start, the most this "
                    f"server queues (--max-queue {self.limit}); try again in {retry} s",
                    type="rate_limit_error", code="queue_full", retry_after=retry)
            self._jobs[id(job)] = self._clock()

    def leave(self, job, started: bool) -> float | None:
        """``job`` started (``started``) or ended before it did; how long it waited (None when
        it was not waiting)."""
        with self._lock:
            since = self._jobs.pop(id(job), None)
            if since is None:
                return None
            now = self._clock()
            if started:
                self._starts.append(now)
                self.started += 1
                self.waited_s += now - since
            return now - since

    def rate(self) -> float | None:
        """Prompts started a second, over the last ``RATE_WINDOW`` starts up to now (a backlog
        that stalls lowers it); None before the first start."""
        if not self._starts:
            return None
        span = self._clock() - self._starts[0]
        return len(self._starts) / span if span > 0 else None

    def retry_after(self, ahead: int) -> int:
        """Seconds until ``ahead`` more requests have started at the measured rate."""
        rate = self.rate()
        if rate is None:
            return RETRY_UNMEASURED_S
        return max(1, min(RETRY_MAX_S, math.ceil(ahead / rate)))

    def oldest_s(self) -> float:
        """How long the longest-waiting request has waited (0 when none waits)."""
        with self._lock:
            first = min(self._jobs.values(), default=None)
        return 0.0 if first is None else self._clock() - first

    def report(self) -> dict:
        """What waits now and what waited: the same at rest however long it rests."""
        return {"waiting": len(self), "max_queue": self.limit, "oldest_wait_s":
                round(self.oldest_s(), 3), "started": self.started,
                "mean_wait_s": round(self.waited_s / self.started, 3) if self.started else 0.0,
                "refused": self.refused}
