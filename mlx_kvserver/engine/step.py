"""A step's two halves: what the scheduler decided to run (:class:`StepPlan`), and running it
(``run_prompts``, ``run_decode``) into what happened (:class:`PromptOutcome`,
:class:`DecodeOutcome`), which the scheduler then applies.

The plan is made by ``Scheduler.plan_prompts`` / ``plan_answers`` (``scheduler.py``): by then the
prompts are started (their cache looked up), the memory policy has answered (``pressure.py``:
chunks cut down, answers preempted) and each decode pass has its drafts to verify. Running it is
forward passes and sampling only (``runner.py``; ``speculation/`` for a verify pass): nothing here
reads or changes the scheduler's state, and an error of a pass is reported, not raised (the
engine never dies with a request).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import mlx.core as mx

from kv_cache.hooks import PagedSequence

from ..chat.output import Delta
from .request import Choice, Request
from .runner import Runner
from .speculation.speculate import Speculation

log = logging.getLogger("mlx_kvserver.engine")


@dataclass
class Piece:
    """One prompt piece of a pass: ``tokens[done:end]`` run on ``seq``. ``choice``: None for a
    request's prompt, else a choice recomputing its tokens (preempted, or one that could not
    share its prompt's pages)."""

    request: Request
    choice: Choice | None
    seq: PagedSequence
    tokens: list[int]
    done: int
    end: int

    @property
    def ids(self) -> list[int]:
        return self.tokens[self.done:self.end]

    @property
    def last(self) -> bool:
        """Whether the piece ends its prompt (its logits give the first token)."""
        return self.end == len(self.tokens)


@dataclass
class Decode:
    """One decode pass: its choices and each one's draft to verify (all empty: a plain step)."""

    choices: list[Choice]
    drafts: list[list[int]]


@dataclass
class StepPlan:
    """What one half of a step runs. The prompt half: ``pieces`` (one forward pass; none when
    every prompt waits) or ``prepare`` (nothing admitted: a chunk of a prepared next turn). The
    answers' half: ``groups`` (one decode pass each: all running answers when the runner batches,
    else one a pass), ``width`` positions a row at most (1 + the most draft tokens), after the
    memory policy ``preempted`` the newest answers (their pages saved) to make it fit."""

    pieces: list[Piece] = field(default_factory=list)
    prepare: bool = False
    groups: list[list[Choice]] = field(default_factory=list)
    width: int = 1
    preempted: list[Choice] = field(default_factory=list)
    started: float = 0.0  # when the plan was begun (perf_counter): starting prompts is in it


@dataclass
class PromptOutcome:
    """A prompt pass: each piece's last logits (None where nobody reads them), when it began
    (``perf_counter``) and its seconds, or the error that failed it."""

    rows: list[mx.array | None]
    began: float = 0.0
    seconds: float = 0.0
    error: Exception | None = None


@dataclass
class DecodeOutcome:
    """A decode pass: each choice's deltas (the tokens it took, streamed; a choice may be done
    after them), or the error that failed it."""

    decode: Decode
    deltas: list[list[Delta]] = field(default_factory=list)
    error: Exception | None = None


def run_prompts(runner: Runner, pieces: list[Piece]) -> PromptOutcome:
    """The prompt pieces in one forward pass (``Runner.prefill_many``)."""
    t0 = time.perf_counter()
    try:
        rows = runner.prefill_many([p.seq for p in pieces], [p.ids for p in pieces],
                                   [p.last for p in pieces], [p.request.images for p in pieces])
    except Exception as e:  # the engine never dies with a request
        log.exception("prompt step failed")
        return PromptOutcome([], error=e)
    return PromptOutcome(rows, t0, time.perf_counter() - t0)


def run_decode(runner: Runner, speculation: Speculation, decode: Decode) -> DecodeOutcome:
    """One decode pass: a verify pass over each choice's last token and draft where any has one
    (``Speculation.verify``), else one token each, sampled by its own sampler; each choice takes
    its tokens (``Choice.accept``)."""
    group = decode.choices
    try:
        if any(decode.drafts):  # one pass verifies every draft (speculation/speculate.py)
            return DecodeOutcome(decode, speculation.verify(group, decode.drafts))
        t0 = time.perf_counter()
        logits = runner.decode([c.seq for c in group], [c.next_token for c in group])
        tokens = [c.sample(logits[i]) for i, c in enumerate(group)]
        mx.eval(tokens)
        ids = [int(t.item()) for t in tokens]
        speculation.decoded(group, time.perf_counter() - t0, ids)
        return DecodeOutcome(decode, [c.accept(t, logits[i])
                                      for i, (c, t) in enumerate(zip(group, ids))])
    except Exception as e:  # the engine never dies with a request
        log.exception("decode step failed")
        return DecodeOutcome(decode, error=e)
