"""Per-request state: the HTTP job, its prompt, its choices (one sequence each), sampling, stop
strings and the events the HTTP layer reads.

A ``Job`` crosses from the HTTP layer to the engine thread; the scheduler turns it into a
``Request`` (prompt checked) whose ``Choice`` objects each own one running sequence. Nothing here
runs the model: ``runner.py`` does, the scheduler decides when.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from kv_cache.manager import Match
from kv_cache.sequence import PagedSequence

from .errors import APIError
from .models import LoadedModel
from .schemas import ChatRequest, SamplingParams


def new_message_id() -> str:
    return f"msg-{uuid.uuid4().hex}"


@dataclass
class Job:
    """One chat completion as the HTTP layer submits it; events flow back on ``events``:
    ``accepted`` (prompt checked, cache looked up), ``start``/``delta``/``finish`` per choice,
    ``usage``, ``error`` and finally ``done``."""

    request: ChatRequest
    lm: LoadedModel
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def emit(self, kind: str, data: Any = None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, data))

    def cancel(self) -> None:
        self.cancelled.set()


class StopMatcher:
    """Finds stop strings in streamed text and says how much text is safe to emit."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, since: int) -> int:
        """Index of the earliest stop string in ``text`` (searching near ``since``), or -1."""
        start = max(0, since - self.longest)
        hits = [i for s in self.stops if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else -1

    def safe_end(self, text: str) -> int:
        """Text up to this index cannot become part of a stop string."""
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return len(text) - k
        return len(text)


class Sampler:
    """Temperature and top-p sampling with mlx-lm's top-p filter, drawing from a random key of
    its own: a seeded choice draws the same tokens whether it runs alone or in a batch (choice
    ``i`` of a request seeds with ``seed + i``)."""

    def __init__(self, params: SamplingParams, index: int = 0):
        self.temperature, self.top_p = params.temperature, params.top_p
        seed = params.seed + index if params.seed is not None else random.getrandbits(62)
        self.key = mx.random.key(seed)

    def __call__(self, logits: mx.array) -> mx.array:
        """A token (lazy) from one row of logits."""
        if self.temperature == 0:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs[None], self.top_p)[0]
        self.key, draw = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1 / self.temperature), key=draw)


class Choice:
    """One answer of a request: its sequence, sampled tokens, streamed text and finish."""

    def __init__(self, request: "Request", index: int, seq: PagedSequence):
        self.request, self.index, self.seq = request, index, seq
        self.message_id = new_message_id()
        self.sampler = Sampler(request.params, index)
        self.tokens: list[int] = []
        self.text = ""
        self.emitted = 0
        self.finish_reason: str | None = None
        self.next_token: int | None = None  # sampled, not yet run through the model
        self.detok = request.lm.tokenizer.stream_decoder()
        self.stops = StopMatcher(request.params.stop)
        self.resume: list[int] | None = None  # preempted: tokens to recompute before going on
        self.resume_done = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def accept(self, token: int) -> None:
        """Take one sampled token: finish on an end token, a stop string or the length limit,
        and stream the text that can no longer become part of a stop string."""
        job = self.request.job
        if token in self.request.lm.tokenizer.eos_token_ids:
            self._finish("stop")
            return
        self.tokens.append(token)
        self.text += self.detok.add(token)
        end = len(self.text)
        if self.stops.stops:
            hit = self.stops.find(self.text, self.emitted)
            if hit >= 0:
                self.text = self.text[:hit]
                self._finish("stop", flush=False)
                return
            end = self.stops.safe_end(self.text)
        if end > self.emitted:
            job.emit("delta", {"index": self.index, "text": self.text[self.emitted:end]})
            self.emitted = end
        if len(self.tokens) >= self.request.max_tokens:
            self._finish("length")
        else:
            self.next_token = token

    def _finish(self, reason: str, flush: bool = True) -> None:
        self.finish_reason, self.next_token = reason, None
        if flush:
            self.text += self.detok.flush()
        if len(self.text) > self.emitted:
            self.request.job.emit("delta", {"index": self.index, "text": self.text[self.emitted:]})
            self.emitted = len(self.text)


class Request:
    """A checked job: prompt tokens, limits, and (once its prompt runs) its choices."""

    def __init__(self, job: Job, arrival: int):
        self.job, self.arrival = job, arrival
        req, lm = job.request, job.lm
        self.lm, self.params, self.n = lm, req.params, req.n
        tok = lm.tokenizer
        self.prompt = tok.encode(tok.render([m.as_template_dict() for m in req.messages],
                                            add_generation_prompt=True))
        room = lm.context_length - len(self.prompt)
        if room < 1:
            raise APIError(400, f"the prompt has {len(self.prompt)} tokens; this model's context "
                           f"is {lm.context_length}", param="messages",
                           code="context_length_exceeded")
        self.max_tokens = min(req.params.max_tokens or room, room)
        self.use_cache = req.use_kv_cache
        self.keys = [m.message_id for m in reversed(req.messages) if m.message_id]
        self.prompt_key = req.messages[-1].message_id
        self.seq: PagedSequence | None = None  # while the prompt runs
        self.match: Match | None = None
        self.done_tokens = 0  # prompt tokens in the sequence so far
        self.logits: mx.array | None = None
        self.choices: list[Choice] = []
        self.started = time.perf_counter()

    @property
    def cancelled(self) -> bool:
        return self.job.cancelled.is_set()

    @property
    def id(self) -> str:
        return self.job.id

    def usage(self) -> dict:
        cached = self.match.tokens if self.match is not None else 0
        return {"prompt_tokens": len(self.prompt),
                "completion_tokens": sum(len(c.tokens) for c in self.choices),
                "cached_tokens": cached}
