"""Continuous batching for one model: requests join and leave a running batch between steps.

Each half of a step is decided, then done (``step.py``): the scheduler plans it from its state
(``plan_prompts``, ``plan_answers``: a ``StepPlan``), the plan's passes run (``run_prompts``,
``run_decode``: forward passes and sampling only), and the scheduler applies what happened.

1. ``step_prompts``: cancelled requests drop what they held (a client that went away frees its
   sequences here); then one prompt chunk (``prefill_chunk`` tokens) of the oldest request whose
   prompt is not done, or of a preempted choice being recomputed: prompts run one chunk per
   step, so a long prompt delays everyone else's next token by one chunk, not by the whole
   prompt. When the oldest prompt ends within the chunk, the next prompts that fit in whole join
   it in the same forward pass (right-padded; models without recurrent state), so the next turns
   of many cached conversations arriving together get their first tokens together. With no
   request, a piece of a prepared next turn is read instead (``prepare.py``).
2. ``step_answers``: one token for every running choice in one forward pass (``Runner.decode``),
   or each one's draft verified (``speculation/``), sampled with its own sampler; text streams
   and choices finish.

Each half returns the events it produced, each with its job (``chat/output.py``: ``Accepted``,
``Start``, deltas, ``Finish``, ``Usage``, ``Error``, ``Done``); the engine hands them over, the
prompts' before the answers' step runs (a first token never waits for the decode step that
computes the second).

A prompt's pages are committed after each chunk, so a request that arrives while another with the
same document is still reading it starts from those pages (a prompt starts only when its first
piece runs, oldest first). ``n > 1`` choices fork the prompt's sequence: siblings share its pages
and one prefix view, and decode in the same batch.

Memory: the policy decides (``pressure.py``), the scheduler acts. When pages run out
(``OutOfBlocksError``), the manager makes room first (resident sequences, then entries:
``CacheManager.with_room``); when that is not enough, prepared next turns give way, then the
youngest other running choice is preempted: its sequence is closed and it is queued to recompute
its tokens (its streamed text stands; with the cache its prompt is found again in pages or on
disk). When no other choice runs, the request goes on uncached: a running sequence keeps its own
positions in working buffers, so pages are the record of a turn, never a condition for answering
it. Under a memory budget, prompts wait or are read in smaller chunks, and the newest answers are
preempted with their pages saved, so they go on later with the same answer.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import mlx.core as mx

from kv_cache import CacheManager, OutOfBlocksError

from ..chat.output import Accepted, Done, Error, Event, Start
from ..config import ServerConfig
from ..errors import RequestError
from .divergence import RecentTurns
from .features import patches
from .prepare import NextTurns
from .pressure import Pressure, give_way, preempted_key
from .request import Choice, Job, Request
from .runner import Runner
from .speculation.speculate import Speculation
from .step import (Decode, DecodeOutcome, Piece, PromptOutcome, StepPlan, run_decode,
                   run_prompts)

log = logging.getLogger("mlx_kvserver.engine")

Events = list[tuple[Job, Event]]


class Scheduler:
    def __init__(self, manager: CacheManager, runner: Runner, *,
                 prefill_chunk: int = ServerConfig.prefill_chunk,
                 max_batch: int = ServerConfig.max_batch,
                 speculate: str = ServerConfig.speculate,
                 num_draft_tokens: int = ServerConfig.num_draft_tokens, draft=None,
                 name: str = "model", memory=None):
        self.manager, self.runner = manager, runner
        self.name, self.memory = name, memory  # engine/memory.py MemoryBudget (None: no budget)
        self.pressure = Pressure(memory, name) if memory is not None else None
        self.speculation = Speculation(runner, speculate, num_draft_tokens,
                                       can_rewind=not manager.has_state, draft=draft,
                                       name=name)
        self.prefill_chunk, self.max_batch = prefill_chunk, max_batch
        self.requests: list[Request] = []  # admitted, oldest first
        self.decoding: list[Choice] = []
        self.prepares = NextTurns(manager, runner, prefill_chunk)  # read while nothing else runs
        self.recent = RecentTurns()  # the last answered turns: why a prompt re-read tokens
        self._arrivals = 0
        self._events: Events = []  # what this step produced, for its jobs

    # -- admission ------------------------------------------------------------------------------

    def add(self, job: Job) -> None:
        """Admit ``job`` (raises ``RequestError`` for a prompt that cannot run)."""
        self._arrivals += 1
        r = Request(job, self._arrivals)
        if self.pressure is not None:
            r.max_tokens = self.pressure.admit(r)  # a 400 for what cannot fit even alone
        self.requests.append(r)

    @property
    def busy(self) -> bool:
        return bool(self.requests or self.prepares)

    @property
    def batch_size(self) -> int:
        return len(self.decoding)

    @property
    def reread(self) -> dict:
        """Prompt tokens read again where a prompt differed from a history held before it."""
        return self.recent.reread

    def waiting(self) -> dict[str, int]:
        """Requests admitted whose prompt has not started, by what they wait for: memory, a
        place in the batch, or the prompts ahead of them (read one chunk a step)."""
        out = {"memory": 0, "batch": 0, "prompts_ahead": 0}
        for r in self.requests:
            if r.seq is None and not r.choices:
                out[r.waiting_for if r.waiting_for in out else "prompts_ahead"] += 1
        return out

    def shed(self) -> int:
        """Under memory pressure (the budget's shedder for this model): the prepared next turns
        go, then the cache gives back what nothing running needs (``CacheManager.shed``); the
        pages freed."""
        self.prepares.clear()
        return self.manager.shed()

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> Events:
        """One step; the events it produced, in order, each with its job."""
        return self.step_prompts() + self.step_answers()

    def step_prompts(self) -> Events:
        """A step's first half: cancellations, then a chunk of the prompts (or, with no request,
        a piece of a prepared next turn). Its events (answers started, with their first tokens)
        are to be handed over before ``step_answers``."""
        self._drop_cancelled()
        plan = self.plan_prompts()
        if plan.prepare:
            self.prepares.step()
        elif plan.pieces:
            self._apply_prompts(plan, run_prompts(self.runner, plan.pieces))
        return self._take_events()

    def step_answers(self) -> Events:
        """A step's second half: one decode step of the running answers."""
        plan = self.plan_answers()
        for group in plan.groups:
            group = [c for c in group if c in self.decoding]  # an earlier pass may end some
            decode = self._drafts(group, plan.width) if group else None
            if decode is not None:
                self._apply_decode(run_decode(self.runner, self.speculation, decode))
        return self._take_events()

    def _send(self, r: Request, *events: Event) -> None:
        self._events += [(r.job, e) for e in events]

    def _take_events(self) -> Events:
        events, self._events = self._events, []
        return events

    def _drop_cancelled(self) -> None:
        for r in [r for r in self.requests if r.cancelled]:
            log.info("%s cancelled by the client", r.id)
            self._end(r, keep=True)  # what it computed is saved, as a finished answer's is

    # -- deciding -------------------------------------------------------------------------------

    def plan_prompts(self) -> StepPlan:
        """The prompt pass of this step: ``prefill_chunk`` prompt tokens, the oldest prompt's
        next piece and, when that finishes it with room to spare, the next prompts that fit in
        whole (several short prompts, e.g. the next turns of cached conversations, in one
        forward pass). Prompts not started yet start here (their cache looked up), where the
        memory policy lets them.

        NOTE: a prompt starts (looks up its cache) only when its first piece runs, so one that
        arrives while another with the same document is still being read finds its pages."""
        if not self.requests and self.prepares:
            return StepPlan(prepare=True)
        if len(self.decoding) >= self.max_batch:
            self._batch_full()
            return StepPlan()
        plan = StepPlan(started=time.perf_counter())
        budget = self.prefill_chunk
        room = self.max_batch - len(self.decoding)  # answers that may still start decoding
        for r, choice in self._prompt_tasks():
            if len(plan.pieces) >= room:
                break
            if self.pressure is not None and choice is None and r.seq is None \
                    and not r.choices and not self._may_start(r):
                continue  # waits for memory
            opened: list = []
            self._guard(r, lambda: opened.append(self._open(r, choice)))
            if not opened:
                continue  # failed (its client has its error)
            seq, tokens, done = opened[0]
            if plan.pieces and len(tokens) - done > budget:
                break  # started; its prompt runs first next step
            want = min(budget, len(tokens) - done)
            if self.pressure is not None:
                want = self.pressure.chunk(done, want, first=not plan.pieces and not self.decoding,
                                           images=self._to_encode(r, done))
                if want == 0:
                    continue  # not even a small chunk fits now: its turn comes again
            end = min(seq.points.stop(done, done + want), len(tokens))  # a state point ends one
            end = whole_images(r.spans, done, end)
            plan.pieces.append(Piece(r, choice, seq, tokens, done, end))
            budget -= end - done
            if budget <= 0 or not self.runner.batched_prompts:
                break
        return plan

    def _to_encode(self, r: Request, done: int) -> list[tuple[int, int, int]]:
        """``(start, end, patches)`` of ``r``'s images from ``done`` on whose features are not
        kept: the vision encoder runs over them in the pass that reads them."""
        features = self.runner.features
        if r.images is None or features is None:
            return []
        return [(s.start, s.end, patches(im)) for s, im in zip(r.images.spans, r.images.images)
                if s.end > done and not features.kept(s)]

    def _batch_full(self) -> None:
        """Prompts wait while ``max_batch`` answers run; each is logged once."""
        for r in self.requests:
            if r.seq is None and not r.choices and r.waiting_for is None:
                r.waiting_for = "batch"
                log.info("%s waits for a place in the batch: %d answers run (--max-batch %d)",
                         r.id, len(self.decoding), self.max_batch)

    def _prompt_tasks(self) -> list[tuple[Request, Choice | None]]:
        """Prompts not done yet, oldest first: (request, None) for a request's prompt, or
        (request, choice) for a choice recomputing its tokens."""
        tasks: list[tuple[Request, Choice | None]] = []
        for r in self.requests:
            if r.seq is not None or not r.choices:
                tasks.append((r, None))
            tasks += [(r, c) for c in r.choices if c.resume is not None and not c.done]
        return tasks

    def _may_start(self, r: Request) -> bool:
        """Whether the memory policy lets ``r``'s prompt start now; it waits for memory if not."""
        ok: list = []
        started = [o for o in self.requests if o is not r and o.seq is not None]
        self._guard(r, lambda: ok.append(self.pressure.may_start(r, started,
                                                                 len(self.decoding))))
        if ok and not ok[0]:
            r.waiting_for = "memory"
        return bool(ok and ok[0])

    def _open(self, r: Request, choice: Choice | None):
        """(sequence, prompt tokens, tokens done) of a task, starting it when it has not."""
        if choice is None:
            if r.seq is None:
                r.seq, r.match = self._start(r, r.prompt, r.keys, r.boundaries
                                             if self.manager.has_state else ())
                r.done_tokens = r.match.tokens
                waited = time.perf_counter() - r.started
                if r.waiting_for is not None:
                    log.info("%s starts after %.1f s waiting (for %s)", r.id, waited,
                             "memory" if r.waiting_for == "memory" else "a place in the batch")
                    r.waiting_for = None
                if r.use_cache:
                    r.divergence = self.recent.diagnose(r)
                self._send(r, Accepted(len(r.prompt), r.match.tokens, r.match.source))
            return r.seq, r.prompt, r.done_tokens
        if choice.seq is None:
            choice.seq, m = self._start(r, choice.resume, choice.resume_keys)
            choice.resume_done = m.tokens
        return choice.seq, choice.resume, choice.resume_done

    def plan_answers(self) -> StepPlan:
        """The decode passes of this step: the running answers (``max_batch`` at most), in one
        pass when the runner batches, and the widest step the memory budget allows (the newest
        answers preempted, their pages saved, where even a plain step would not fit)."""
        if not self.decoding:
            return StepPlan()
        plan = StepPlan(width=1 + self.speculation.max_draft)
        if self.pressure is not None:
            running = self.decoding[: self.max_batch]
            context = max(len(c.seq.tokens) for c in running)
            plan.width, fits = self.pressure.width(len(running), plan.width, context)
            if not fits:
                for victim in self.pressure.victims(self.decoding, len(running), plan.width,
                                                    context):
                    self.preempt(victim, save=True)
                    plan.preempted.append(victim)
        running = self.decoding[: self.max_batch]
        plan.groups = [running] if self.runner.batched else [[c] for c in running]
        return plan

    def _drafts(self, group: list[Choice], width: int) -> Decode | None:
        """A decode pass of ``group`` with each choice's draft to verify (speculation's, cut to
        the step's ``width``); None where drafting failed (its requests have their error)."""
        try:
            return Decode(group, [d[:width - 1] for d in self.speculation.drafts(group)])
        except Exception as e:  # the engine never dies with a request
            log.exception("decode step failed")
            self._fail_group(group, e)
            return None

    # -- memory: room and preemption ------------------------------------------------------------

    def _with_room(self, r: Request, fn: Callable[[], object]) -> bool:
        """Run ``fn``, which takes pages, with the room the manager can make; when that is not
        enough, what the policy says gives way (``pressure.give_way``) and ``fn`` is tried
        again. False when nothing gives way and it still does not fit (the caller goes on
        without caching: running sequences keep their positions in their own buffers, so a
        request never needs pages to be answered)."""
        while True:
            try:
                self.manager.with_room(fn)
                return True
            except OutOfBlocksError:
                way = give_way(bool(self.prepares), self.decoding, r)
                if way.prepared:
                    self.prepares.clear()
                elif way.preempt is not None:
                    self.preempt(way.preempt)
                else:
                    return False

    def _start(self, r: Request, tokens: list[int], keys: list[str], boundaries=()):
        """``manager.start`` with room made for what it loads; uncached when there is none.
        A prompt with images passes its spans (a reuse holds only with the same images in the
        same places) and its sequence carries the prompt's ``rope_delta`` (the runner's
        positions after the images)."""
        out: list = []
        if not (r.use_cache and self._with_room(r, lambda: out.append(self.manager.start(
                tokens, keys, use_cache=True, boundaries=boundaries, spans=r.spans)))):
            r.use_cache = False
            out = [self.manager.start(tokens, keys, use_cache=False)]
        if r.rope_delta:
            out[0][0].rope_delta = r.rope_delta
        return out[0]

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

    # -- applying what a pass did ---------------------------------------------------------------

    def _apply_prompts(self, plan: StepPlan, out: PromptOutcome) -> None:
        """A prompt pass's outcome: pages committed, prompts that ended start their answers
        (first tokens sampled from the pass's logits); a failed pass fails its requests."""
        requests = list({id(p.request): p.request for p in plan.pieces}.values())  # each once
        if out.error is not None:
            for r in requests:
                self._fail(r, RequestError(500, f"generation failed: {out.error}",
                                           type="server_error"))
            return
        log.debug("prompt pass: %d sequences, %d tokens, %.0f ms (%.0f ms starting them)",
                  len(plan.pieces), sum(p.end - p.done for p in plan.pieces), out.seconds * 1e3,
                  (out.began - plan.started) * 1e3)
        for r in requests:
            r.forward_s += out.seconds
        for p, row in zip(plan.pieces, out.rows):
            if p.request in self.requests:
                self._guard(p.request, lambda: self._after_piece(p, row))

    def _after_piece(self, p: Piece, logits: mx.array) -> None:
        r, choice = p.request, p.choice
        if r.use_cache:  # its pages are there for whoever shares the prefix
            if not self._with_room(r, p.seq.commit):
                log.warning("%s: out of KV cache pages; this answer is not cached", r.id)
                r.use_cache = False
        if choice is not None:
            choice.resume_done = p.end
            if p.last:
                choice.resume = None
                self.decoding.append(choice)
                if choice.next_token is None:  # a choice recomputing its prompt: first token
                    self._first_token(choice, logits)
            return
        r.done_tokens = p.end
        if not p.last:
            return
        log.info("%s: %d prompt tokens, %d from cache (%s), %.3fs since it arrived, %.3fs of "
                 "it in forward passes", r.id, len(p.tokens), r.match.tokens, r.match.source,
                 time.perf_counter() - r.started, r.forward_s)
        self._start_choices(r, logits)

    def _start_choices(self, r: Request, logits: mx.array) -> None:
        seq, r.seq = r.seq, None
        if r.use_cache and r.prompt_key:
            self._save(r.prompt_key, seq)
        seqs = [seq]
        if r.n > 1 and r.use_cache:
            try:
                self.manager.with_room(seq.share_prefix)
                seqs += [self.manager.with_room(seq.fork) for _ in range(r.n - 1)]
                for s in seqs[1:] if r.rope_delta else ():
                    s.rope_delta = r.rope_delta
            except OutOfBlocksError as e:  # the prompt does not fit the page pool
                log.warning("%s: %s; each choice recomputes the prompt", r.id, e)
                for s in seqs[1:]:
                    s.close()
                seqs = [seq]
        r.choices = [Choice(r, i, seqs[i] if i < len(seqs) else None) for i in range(r.n)]
        for c in r.choices:
            if c.seq is None:  # no cache (or no room): this choice computes the prompt again
                c.resume, c.resume_done = list(r.prompt), 0
        for c in r.choices:
            if c.seq is not None:
                self.decoding.append(c)
                self._first_token(c, logits)

    def _first_token(self, c: Choice, logits: mx.array) -> None:
        self._send(c.request, Start(c.index, c.message_id),
                   *c.accept(int(c.sample(logits).item()), logits))
        if c.done:
            self._finish(c)

    def _apply_decode(self, out: DecodeOutcome) -> None:
        """A decode pass's outcome: each choice's deltas streamed, the finished ones finished; a
        failed pass fails its requests."""
        group = out.decode.choices
        if out.error is not None:
            self._fail_group(group, out.error)
            return
        for c, deltas in zip(group, out.deltas):
            self._send(c.request, *deltas)
            if c.done:
                self._finish(c)

    def _finish(self, c: Choice) -> None:
        r = c.request
        if c in self.decoding:
            self.decoding.remove(c)
        self._send(r, c.finish_event())
        seq, c.seq = c.seq, None
        self.speculation.release(c, c.message_id if r.use_cache else None)
        if seq is not None and r.use_cache:  # its token ids: drafts for other answers
            self.speculation.saved(seq.tokens)
        if r.use_cache:
            self._save(c.message_id, seq)
        if c.index == 0:
            self.recent.add(r.prompt + c.tokens, len(r.prompt))
        if r.use_cache and r.n == 1:
            self.manager.keep(seq)  # the next turn of this conversation goes on from it
            self.prepares.plan(c)
        else:
            seq.close()
        self._retire(r)

    def _retire(self, r: Request) -> None:
        # NOTE: choices done in the same step are each finished first (saved, kept)
        if r.choices and all(c.done and c not in self.decoding for c in r.choices) \
                and r in self.requests:
            self._send(r, r.usage())
            self._end(r, finished=True)

    def _save(self, key: str, seq) -> None:
        try:
            self.manager.save(key, seq)
        except OutOfBlocksError as e:  # the answer still goes out, without a cache entry
            log.warning("not caching %s: %s", key, e)

    # -- ending ---------------------------------------------------------------------------------

    def _guard(self, r: Request, fn: Callable[[], None]) -> None:
        """Run ``fn`` for ``r``; an error fails ``r`` alone (the engine never dies with one)."""
        try:
            fn()
        except RequestError as e:
            self._fail(r, e)
        except Exception as e:
            log.exception("%s failed", r.id)
            self._fail(r, RequestError(500, f"generation failed: {e}", type="server_error"))

    def _fail_group(self, group: list[Choice], error: Exception) -> None:
        for r in {id(c.request): c.request for c in group}.values():
            self._fail(r, RequestError(500, f"generation failed: {error}", type="server_error"))

    def _fail(self, r: Request, error: RequestError) -> None:
        self._send(r, Error(error))
        self._end(r)

    def _end(self, r: Request, finished: bool = False, keep: bool = False) -> None:
        """Free everything ``r`` holds and say it is ``Done``; ``keep``: save what its prompt
        and answers computed first (a cancelled request: the client may send it back)."""
        keep = keep and r.use_cache
        if r.seq is not None:
            if keep and r.prompt_key and len(r.seq.tokens):
                self._save(r.prompt_key, r.seq)
            r.seq.close()
            r.seq = None
        for c in r.choices:
            if c in self.decoding:
                self.decoding.remove(c)
            self.speculation.release(c, c.message_id if keep else None)
            if c.seq is not None:
                if keep and c.tokens:
                    self._save(c.message_id, c.seq)
                c.seq.close()
                c.seq = None
        if r in self.requests:
            self.requests.remove(r)
        self._send(r, Done())

    def fail_all(self, error: RequestError) -> Events:
        """Fail every admitted request (a step that broke); their events."""
        for r in list(self.requests):
            self._fail(r, error)
        return self._take_events()

    def close(self) -> Events:
        self.prepares.clear()
        return self.fail_all(RequestError(503, "the server is shutting down",
                                          type="server_error"))


def whole_images(spans, done: int, end: int) -> int:
    """The end of a prompt piece from ``done`` that would end at ``end``, moved so that it cuts
    no image's span (``(start, length, image)`` each): back to the image's start, or past its
    end where the piece begins with it (an image's tokens run in one pass)."""
    for start, length, _ in spans:
        if start < end < start + length:
            return start if start > done else start + length
    return end
