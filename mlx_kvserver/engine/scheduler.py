"""Continuous batching for one model: requests join and leave a running batch between steps.

Each ``step()``:

1. drops what cancelled requests held (a client that went away frees its sequences here);
2. runs one prompt chunk (``prefill_chunk`` tokens) of the oldest request whose prompt is not
   done, or of a preempted choice being recomputed: prompts run one chunk per step, so a long
   prompt delays everyone else's next token by one chunk, not by the whole prompt. When the
   oldest prompt ends within the chunk, the next prompts that fit in whole join it in the same
   forward pass (right-padded; models without recurrent state), so the next turns of many
   cached conversations arriving together get their first tokens together;
3. decodes one token for every running choice in one forward pass (``Runner.decode``), samples
   each with its own sampler, streams text and finishes choices.

``step()`` returns the events it produced, each with its job (``chat/output.py``: ``Accepted``,
``Start``, deltas, ``Finish``, ``Usage``, ``Error``, ``Done``); the engine hands them over.

A prompt's pages are committed after each chunk, so a request that arrives while another with the
same document is still reading it starts from those pages (a prompt starts only when its first
piece runs, oldest first). ``n > 1`` choices fork the
prompt's sequence: siblings share its pages and one prefix view, and decode in the same batch.

Memory: when pages run out (``OutOfBlocksError``), the manager makes room first (resident
sequences, then entries: ``CacheManager.with_room``); when that is not enough, prepared next turns
give way, then the youngest other running choice is preempted:
its sequence is closed and it is queued to recompute its tokens (its streamed text stands; with
the cache its prompt is found again in pages or on disk). When no other choice runs, the request
goes on uncached: a running sequence keeps its own positions in working buffers, so pages are the
record of a turn, never a condition for answering it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import mlx.core as mx

from kv_cache import CacheManager, OutOfBlocksError

from ..chat.output import Accepted, Done, Error, Event, Start
from ..config import ServerConfig
from .divergence import RecentTurns, explain
from ..errors import RequestError
from .prepare import NextTurns
from .preemption import Preemption
from .pressure import Pressure
from .request import Choice, Job, Request
from .runner import Runner
from .speculation.speculate import Speculation

log = logging.getLogger("mlx_kvserver.engine")

Events = list[tuple[Job, Event]]


class Scheduler(Preemption):
    def __init__(self, manager: CacheManager, runner: Runner, *,
                 prefill_chunk: int = ServerConfig.prefill_chunk,
                 max_batch: int = ServerConfig.max_batch,
                 speculate: str = ServerConfig.speculate,
                 num_draft_tokens: int = ServerConfig.num_draft_tokens, draft=None,
                 name: str = "model", memory=None):
        self.manager, self.runner = manager, runner
        self.name, self.memory = name, memory  # engine/memory.py MemoryBudget (None: no budget)
        self.pressure = Pressure(self, memory) if memory is not None else None
        self.speculation = Speculation(runner, speculate, num_draft_tokens,
                                       can_rewind=not manager.has_state, draft=draft,
                                       name=name)
        self.prefill_chunk, self.max_batch = prefill_chunk, max_batch
        self.requests: list[Request] = []  # admitted, oldest first
        self.decoding: list[Choice] = []
        self.prepares = NextTurns(manager, runner, prefill_chunk)  # read while nothing else runs
        self.recent = RecentTurns()  # the last answered turns: why a prompt re-read tokens
        self.reread = {"tokens": 0, "turns": 0, "last": None}  # for the cache stats
        self._arrivals = 0
        self._events: Events = []  # what this step produced, for its jobs

    # -- admission ------------------------------------------------------------------------------

    def add(self, job: Job) -> None:
        """Admit ``job`` (raises ``RequestError`` for a prompt that cannot run)."""
        self._arrivals += 1
        r = Request(job, self._arrivals)
        if self.pressure is not None:
            self.pressure.admit(r)  # a 400 for what cannot fit even alone
        self.requests.append(r)

    @property
    def busy(self) -> bool:
        return bool(self.requests or self.prepares)

    @property
    def batch_size(self) -> int:
        return len(self.decoding)

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> Events:
        """One step; the events it produced, in order, each with its job."""
        return self.step_prompts() + self.step_answers()

    def step_prompts(self) -> Events:
        """A step's first part: cancellations, then a chunk of the prompts (or, with no request,
        a piece of a prepared next turn). Its events (answers started, with their first tokens)
        are to be handed over before ``step_answers``: a first token never waits for the decode
        step that computes the second."""
        for r in [r for r in self.requests if r.cancelled]:
            log.info("%s cancelled by the client", r.id)
            self._end(r, keep=True)  # what it computed is saved, as a finished answer's is
        if not self.requests and self.prepares:
            self.prepares.step()
        elif len(self.decoding) < self.max_batch:
            self._prefill(self._prompt_tasks())
        else:
            self._batch_full()
        return self._take_events()

    def _batch_full(self) -> None:
        """Prompts wait while ``max_batch`` answers run; each is logged once."""
        for r in self.requests:
            if r.seq is None and not r.choices and r.waiting_for is None:
                r.waiting_for = "batch"
                log.info("%s waits for a place in the batch: %d answers run (--max-batch %d)",
                         r.id, len(self.decoding), self.max_batch)

    def waiting(self) -> dict[str, int]:
        """Requests admitted whose prompt has not started, by what they wait for: memory, a
        place in the batch, or the prompts ahead of them (read one chunk a step)."""
        out = {"memory": 0, "batch": 0, "prompts_ahead": 0}
        for r in self.requests:
            if r.seq is None and not r.choices:
                out[r.waiting_for if r.waiting_for in out else "prompts_ahead"] += 1
        return out

    def step_answers(self) -> Events:
        """A step's second part: one decode step of the running answers."""
        if self.decoding:
            self._decode()
        return self._take_events()

    def _send(self, r: Request, *events: Event) -> None:
        self._events += [(r.job, e) for e in events]

    def _take_events(self) -> Events:
        events, self._events = self._events, []
        return events

    def _prompt_tasks(self) -> list[tuple[Request, Choice | None]]:
        """Prompts not done yet, oldest first: (request, None) for a request's prompt, or
        (request, choice) for a choice recomputing its tokens."""
        tasks: list[tuple[Request, Choice | None]] = []
        for r in self.requests:
            if r.seq is not None or not r.choices:
                tasks.append((r, None))
            tasks += [(r, c) for c in r.choices if c.resume is not None and not c.done]
        return tasks

    def _prefill(self, tasks: list[tuple[Request, Choice | None]]) -> None:
        """One chunk of ``prefill_chunk`` prompt tokens: the oldest prompt's next piece and,
        when that finishes it with room to spare, the next prompts that fit in whole (several
        short prompts, e.g. the next turns of cached conversations, in one forward pass).

        NOTE: a prompt starts (looks up its cache) only when its first piece runs, so one that
        arrives while another with the same document is still being read finds its pages."""
        batch: list[tuple] = []
        budget = self.prefill_chunk
        t_open = time.perf_counter()
        room = self.max_batch - len(self.decoding)  # answers that may still start decoding
        for r, choice in tasks:
            if len(batch) >= room:
                break
            if self.pressure is not None and choice is None and r.seq is None \
                    and not r.choices and not self._may_start(r):
                continue  # waits for memory (a 503 after a while)
            opened: list = []
            self._guard(r, lambda: opened.append(self._open(r, choice)))
            if not opened:
                continue  # failed (its client has its error)
            seq, tokens, done = opened[0]
            if batch and len(tokens) - done > budget:
                break  # started; its prompt runs first next step
            want = min(budget, len(tokens) - done)
            if self.pressure is not None:
                want = self.pressure.chunk(r, done, want, first=not batch and not self.decoding)
                if want == 0:
                    continue  # not even a small chunk fits now: its turn comes again
            piece = tokens[done : seq.points.stop(done, done + want)]  # a state point ends one
            batch.append((r, choice, seq, tokens, done + len(piece), piece))
            budget -= len(piece)
            if budget <= 0 or not self.runner.batched_prompts:
                break
        if not batch:
            return
        requests = list({id(b[0]): b[0] for b in batch}.values())  # each once
        t0 = time.perf_counter()
        try:
            logits = self.runner.prefill_many([b[2] for b in batch], [b[5] for b in batch],
                                              [b[4] == len(b[3]) for b in batch])
        except Exception as e:  # the engine never dies with a request
            log.exception("prompt step failed")
            for r in requests:
                self._fail(r, RequestError(500, f"generation failed: {e}", type="server_error"))
            return
        spent = time.perf_counter() - t0
        log.debug("prompt pass: %d sequences, %d tokens, %.0f ms (%.0f ms starting them)",
                  len(batch), sum(len(b[5]) for b in batch), spent * 1e3, (t0 - t_open) * 1e3)
        for r in requests:
            r.forward_s += spent
        for (r, choice, seq, tokens, done, _), row in zip(batch, logits):
            if r in self.requests:
                self._guard(r, lambda: self._after_piece(r, choice, seq, tokens, done, row))

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
                self._why_reread(r)
                self._send(r, Accepted(len(r.prompt), r.match.tokens, r.match.source))
            return r.seq, r.prompt, r.done_tokens
        if choice.seq is None:
            choice.seq, m = self._start(r, choice.resume, choice.resume_keys)
            choice.resume_done = m.tokens
        return choice.seq, choice.resume, choice.resume_done

    def _after_piece(self, r: Request, choice: Choice | None, seq, tokens: list[int],
                     done: int, logits: mx.array) -> None:
        if r.use_cache:  # its pages are there for whoever shares the prefix
            if not self._with_room(r, seq.commit):
                log.warning("%s: out of KV cache pages; this answer is not cached", r.id)
                r.use_cache = False
        if choice is not None:
            choice.resume_done = done
            if done == len(tokens):
                choice.resume = None
                self.decoding.append(choice)
                if choice.next_token is None:  # a choice recomputing its prompt: first token
                    self._first_token(choice, logits)
            return
        r.done_tokens = done
        if done < len(tokens):
            return
        log.info("%s: %d prompt tokens, %d from cache (%s), %.3fs since it arrived, %.3fs of "
                 "it in forward passes", r.id, len(tokens), r.match.tokens, r.match.source,
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

    # -- decode ---------------------------------------------------------------------------------

    def _decode(self) -> None:
        width = 1 + self.speculation.max_draft
        if self.pressure is not None:  # the widest step that fits (answers preempted if not)
            running = self.decoding[: self.max_batch]
            width = self.pressure.step(len(running), width,
                                       max(len(c.seq.tokens) for c in running))
        running = self.decoding[: self.max_batch]
        if self.runner.batched:
            groups = [running]
        else:
            groups = [[c] for c in running]
        for group in groups:
            try:
                drafts = [d[:width - 1] for d in self.speculation.drafts(group)]
                if any(drafts):  # one pass verifies every draft (engine/speculation/speculate.py)
                    outs = self.speculation.verify(group, drafts)
                else:
                    t0 = time.perf_counter()
                    logits = self.runner.decode([c.seq for c in group],
                                                [c.next_token for c in group])
                    tokens = [c.sample(logits[i]) for i, c in enumerate(group)]
                    mx.eval(tokens)
                    ids = [int(t.item()) for t in tokens]
                    self.speculation.decoded(group, time.perf_counter() - t0, ids)
                    outs = [c.accept(t, logits[i]) for i, (c, t) in enumerate(zip(group, ids))]
            except Exception as e:  # the engine never dies with a request
                log.exception("decode step failed")
                for r in {id(c.request): c.request for c in group}.values():
                    self._fail(r, RequestError(500, f"generation failed: {e}", type="server_error"))
                continue
            for c, deltas in zip(group, outs):
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

    def _why_reread(self, r: Request) -> None:
        """Where ``r``'s prompt differs from a history held before it (``divergence.py``)."""
        found = self.recent.find(r.prompt) if r.use_cache else None
        if found is None:
            return
        try:
            r.divergence = d = explain(r, *found)
            self.reread.update(tokens=self.reread["tokens"] + d.reread_tokens,
                               turns=self.reread["turns"] + 1, last=d.as_dict())
        except Exception:  # a diagnosis never fails a request
            log.exception("%s: could not explain the re-read", r.id)
            return
        log.info("%s re-reads %d tokens: its prompt differs at token %d (message %s) from a "
                 "history held before: %r, was %r", r.id, d.reread_tokens, d.position,
                 d.message_index, d.prompt_excerpt, d.cached_excerpt)

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

    # -- memory pressure ------------------------------------------------------------------------

    def _guard(self, r: Request, fn: Callable[[], None]) -> None:
        """Run ``fn`` for ``r``; an error fails ``r`` alone (the engine never dies with one)."""
        try:
            fn()
        except RequestError as e:
            self._fail(r, e)
        except Exception as e:
            log.exception("%s failed", r.id)
            self._fail(r, RequestError(500, f"generation failed: {e}", type="server_error"))

    # -- ending ---------------------------------------------------------------------------------

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
