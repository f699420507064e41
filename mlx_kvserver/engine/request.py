"""Per-request state: the job the HTTP layer submits, its prompt, its choices (one sequence
each), sampling, stop strings, output parsing and the events the HTTP layer reads.

A ``Job`` crosses from the HTTP layer to the engine thread with a ``Conversation``
(``chat/conversation.py``), never an HTTP type, made ready where it is submitted (``Prompt``:
rendered, tokenized and checked, so the engine thread runs passes only); the scheduler turns it
into a ``Request`` whose ``Choice`` objects each own one running sequence. Nothing here runs the
model: ``runner.py`` does, the scheduler decides when.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from kv_cache import Match
from kv_cache.hooks import PagedSequence, boundaries

from ..chat.conversation import Conversation, Image
from ..chat.output import Delta, Divergence, Event, Finish, TextDelta, TokenLogprob, Usage
from ..chat.render import encode, render
from ..chat.support import chat_support
from ..errors import RequestError
from ..models.image_prompt import ImagePrompt, image_prompt
from ..models.loading import LoadedModel
from .speculation.prediction import Prediction
from .sampling import Sampler, StopMatcher, token_logprob


def new_message_id() -> str:
    return f"msg-{uuid.uuid4().hex}"


@dataclass
class Job:
    """One request as an API module submits it; its events (``chat/output.py``: ``Accepted``,
    per choice ``Start``, deltas and ``Finish``, then ``Usage``, or an ``Error``; ``Done`` last)
    come back on ``events``, put there by the engine thread (``send``)."""

    conversation: Conversation
    lm: LoadedModel
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    answer_ids: list[str] = field(default_factory=list)  # message ids the API chose, by choice
    prompt: "Prompt | None" = None  # its conversation made ready (``prepare``)

    def prepare(self) -> "Prompt":
        """Render and tokenize the conversation and check it (``Prompt.of``), once: where the
        job is submitted, so the engine thread runs passes only (a ``RequestError`` for a prompt
        that cannot run)."""
        if self.prompt is None:
            self.prompt = Prompt.of(self.conversation, self.lm)
        return self.prompt

    def send(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled.set()


class Choice:
    """One answer of a request: its sequence, sampled tokens, streamed text and finish."""

    def __init__(self, request: "Request", index: int, seq: PagedSequence | None):
        self.request, self.index, self.seq = request, index, seq
        ids = request.job.answer_ids
        self.message_id = ids[index] if index < len(ids) else new_message_id()
        conv = request.conversation
        matcher = request.grammar.matcher() if request.grammar is not None else None
        self.sampler = Sampler(conv.sampling, index, matcher)
        self.tokens: list[int] = []
        self.text = ""  # raw text (stop strings are looked for here)
        self.emitted = 0  # raw text handed to the parser
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None
        self.next_token: int | None = None  # sampled, not yet run through the model
        self.detok = request.lm.tokenizer.stream_decoder(
            skip_special_tokens=not request.keep_markers)
        self.stops = StopMatcher(conv.sampling.stop)
        self.parser = request.support.output_parser(
            index, conv.tools if conv.calls_tools else [], request.in_reasoning,
            conv.parallel_tool_calls and conv.tool_choice.mode != "function") \
            if request.parse_output else None
        self.reasoning_tokens = 0
        self.logprobs: list[TokenLogprob] = []
        self._pending_logprobs: list[TokenLogprob] = []
        self.resume: list[int] | None = None  # preempted: tokens to recompute before going on
        self.resume_done = 0
        self.resume_keys: list[str] = []  # where its pages were saved when it was preempted
        self.drafter = None  # speculation/drafts.py Drafter, made at its first decode step
        self.draft_seq = None  # its sequence in the draft model's cache (draft_model.py)
        self.draft_source = ""  # where the last draft came from
        self.steps = 0  # decode forward passes this choice took part in
        self.drafted = self.accepted = 0  # draft tokens verified, and of them taken
        # where the answer is in the client's prediction (its usage), with or without drafts
        self.predicted = Prediction(request.prediction) if request.prediction else None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def sample(self, logits: mx.array) -> mx.array:
        return self.sampler(logits)

    def accept(self, token: int, logits: mx.array | None = None) -> list[Delta]:
        """Take one sampled token: finish on an end token, a stop string, the grammar's end or
        the length limit; the deltas of the text that can no longer become part of a stop
        string."""
        r = self.request
        if token in r.lm.tokenizer.eos_token_ids:
            return self._finish("stop")
        self.sampler.advance(token)
        self.tokens.append(token)
        if self.predicted is not None:
            self.predicted.add(token)
        if r.top_logprobs is not None and logits is not None:
            lp = token_logprob(logits, token, r.top_logprobs, r.lm.tokenizer.decode)
            self.logprobs.append(lp)
            self._pending_logprobs.append(lp)
        thinking = self.parser is not None and self.parser.in_reasoning
        self.text += self.detok.add(token)
        end = len(self.text)
        if self.stops.stops:
            hit = self.stops.match(self.text, self.emitted)
            if hit is not None:
                self.text, self.stop_sequence = self.text[:hit[0]], hit[1]
                return self._finish("stop", flush=False)
            end = self.stops.safe_end(self.text)
        out: list[Delta] = []
        if end > self.emitted:
            out = self._out(self.text[self.emitted:end])
            self.emitted = end
        if thinking or (self.parser is not None and self.parser.in_reasoning):
            self.reasoning_tokens += 1
        if self.sampler.finished or (self.parser is not None and self.parser.ended):
            return out + self._finish("stop")
        if len(self.tokens) >= r.max_tokens:
            return out + self._finish("length")
        self.next_token = token
        return out

    def _out(self, text: str) -> list[Delta]:
        if self.parser is None:
            return self._with_logprobs([TextDelta(self.index, text)] if text else [])
        return self._with_logprobs(self.parser.feed(text))

    def _with_logprobs(self, deltas: list[Delta]) -> list[Delta]:
        """The log-probabilities of the tokens sampled since the last text go with the next."""
        out = []
        for d in deltas:
            if isinstance(d, TextDelta) and self._pending_logprobs:
                d = TextDelta(d.index, d.text, tuple(self._pending_logprobs))
                self._pending_logprobs = []
            out.append(d)
        return out

    def _finish(self, reason: str, flush: bool = True) -> list[Delta]:
        self.finish_reason, self.next_token = reason, None
        if flush:
            self.text += self.detok.flush()
        out: list[Delta] = []
        if len(self.text) > self.emitted:
            out = self._out(self.text[self.emitted:])
            self.emitted = len(self.text)
        if self.parser is not None:
            out += self._with_logprobs(self.parser.finish(cut=reason == "length"))
            self.finish_reason = self.parser.finish_reason(reason)
        return out

    def finish_event(self) -> Finish:
        p = self.parser
        return Finish(index=self.index, reason=self.finish_reason or "stop",
                      message_id=self.message_id, text=p.text if p else self.text,
                      reasoning=p.reasoning if p else "",
                      tool_calls=tuple(p.tool_calls) if p else (),
                      logprobs=tuple(self.logprobs), stop_sequence=self.stop_sequence,
                      tokens=len(self.tokens), reasoning_tokens=self.reasoning_tokens)


@dataclass
class Prompt:
    """A conversation made ready for the engine before it is queued: rendered with the model's
    chat template and tokenized (``tokens``), checked against the model (its vocabulary and
    context), its answer's grammar compiled and a client's prediction tokenized."""

    tokens: list[int]
    param: str  # the field a client shortens when its prompt is what does not fit
    max_tokens: int  # the most answer tokens: what the client asked, within the context
    in_reasoning: bool = False  # the template opened a reasoning block the answer goes on in
    grammar: Any = None  # what constrains the answer (``chat/constraints.py``), or None
    prediction: list[int] = field(default_factory=list)  # a client's prediction, tokenized
    images: ImagePrompt | None = None  # a prompt with images: spans, pixels and positions

    @property
    def spans(self) -> tuple:
        """Its image spans, ``(start, length, image hash)`` each (none for text)."""
        return self.images.spans if self.images is not None else ()

    @property
    def rope_delta(self) -> int:
        """The position offset of its tokens after its images (0 for text)."""
        return self.images.rope_delta if self.images is not None else 0

    @classmethod
    def of(cls, conv: Conversation, lm: LoadedModel) -> "Prompt":
        """``conv`` made ready for ``lm``; a ``RequestError`` 400 for a prompt that cannot run
        (empty, longer than the context, token ids outside the vocabulary, a schema that does
        not compile)."""
        tok = lm.tokenizer
        support = chat_support(lm)
        in_reasoning = False
        images = None
        pictures = [p for m in conv.messages for p in m.parts if isinstance(p, Image)]
        if conv.prompt is None and pictures and lm.processor is not None:
            # the processor expands each image's placeholder to its tokens (image_prompt.py)
            rendered = render(tok, support.format, conv, images=True)
            images = _image_prompt(lm, rendered.text, pictures, conv)
            tokens, in_reasoning = list(images.tokens), rendered.in_reasoning
        elif conv.prompt is None:
            tokens, rendered = encode(tok, support.format, conv)
            in_reasoning = rendered.in_reasoning
        elif isinstance(conv.prompt, str):
            tokens = tok.encode(conv.prompt)
        else:
            tokens = list(conv.prompt)
            if any(not 0 <= t < support.vocab_size for t in tokens):
                raise RequestError(400, "the prompt has token ids outside this model's "
                                   f"vocabulary (0..{support.vocab_size - 1})", param="prompt")
        param = "messages" if conv.prompt is None else "prompt"
        if not tokens:
            raise RequestError(400, "the prompt is empty", param="prompt")
        room = lm.context_length - len(tokens)
        if room < 1:
            raise RequestError(400, f"the prompt has {len(tokens)} tokens; this model's "
                               f"context is {lm.context_length}", param=param,
                               code="context_length_exceeded")
        return cls(tokens, param, min(conv.sampling.max_tokens or room, room), in_reasoning,
                   support.grammar_for(conv),  # a 400 for a schema that cannot compile
                   tok.encode(conv.prediction) if conv.prediction else [], images)


def _image_prompt(lm: LoadedModel, text: str, pictures: list[Image],
                  conv: Conversation) -> ImagePrompt:
    """``image_prompt``; where the images and their placeholders do not match and a tool
    result holds images, the 400 says that the model's chat template does not show an image
    in a tool result (it printed no placeholder for it)."""
    try:
        return image_prompt(lm, text, pictures)
    except RequestError as e:
        if e.code != "images_not_supported" or not any(
                m.role == "tool" and m.images for m in conv.messages):
            raise
        raise RequestError(400, "this model's chat template does not show images in tool "
                           f"results ({e.message}); send them in a user message",
                           param="messages", code="images_not_supported") from e


class Request:
    """A job admitted to a scheduler: its prompt (made ready where it was submitted), limits,
    grammar, and (once its prompt runs) its choices."""

    def __init__(self, job: Job, arrival: int):
        self.job, self.arrival = job, arrival
        conv, lm = job.conversation, job.lm
        self.conversation, self.lm, self.n = conv, lm, conv.n
        ready = job.prepare()
        self.support = support = chat_support(lm)
        self.prompt, self.prompt_param = ready.tokens, ready.param
        self.in_reasoning = ready.in_reasoning
        self.parse_output = conv.prompt is None  # raw completions are not chat: text as it is
        self.max_tokens = ready.max_tokens
        s = conv.sampling
        self.top_logprobs = s.top_logprobs if s.logprobs else None
        self.grammar = ready.grammar
        # tool-call markers and think tags may be special tokens: the parser must see them
        self.keep_markers = self.parse_output and support.markers_special
        self.use_cache = conv.use_kv_cache
        self.speculate = conv.speculate  # drafts verified in the batch (speculation/speculate.py)
        self.prediction: list[int] = ready.prediction
        self.images = ready.images  # a prompt with images (models/image_prompt.py), or None
        self.spans, self.rope_delta = ready.spans, ready.rope_delta
        msgs = conv.messages
        self.keys = [m.message_id for m in reversed(msgs) if m.message_id]
        self.prompt_key = msgs[-1].message_id if msgs and not conv.continue_final else None
        self.seq: PagedSequence | None = None  # while the prompt runs
        self.match: Match | None = None
        self.done_tokens = 0  # prompt tokens in the sequence so far
        self.logits: mx.array | None = None
        self.divergence: Divergence | None = None  # why it re-read tokens, when it did
        self.choices: list[Choice] = []
        self.started = time.perf_counter()  # admitted (rendered and checked before)
        self.waiting_for: str | None = None  # what it waits for to start (pressure.py)
        self.forward_s = 0.0  # wall time of the forward passes that ran its prompt

    @functools.cached_property
    def boundaries(self) -> list[int]:
        """Prompt positions right after each end-of-turn token: where its messages end (a
        model with recurrent state snapshots its state there:
        ``kv_cache/model/state_points.py``)."""
        return boundaries(self.prompt, self.lm.tokenizer.eos_token_ids)

    @property
    def cancelled(self) -> bool:
        return self.job.cancelled.is_set()

    @property
    def id(self) -> str:
        return self.job.id

    def usage(self) -> Usage:
        cached = self.match.tokens if self.match is not None else 0
        cs = self.choices
        return Usage(prompt_tokens=len(self.prompt),
                     completion_tokens=sum(len(c.tokens) for c in cs),
                     cached_tokens=cached, divergence=self.divergence,
                     reasoning_tokens=sum(c.reasoning_tokens for c in cs),
                     draft_accepted=sum(c.accepted for c in cs),
                     draft_rejected=sum(c.drafted - c.accepted for c in cs),
                     prediction_accepted=sum(c.predicted.accepted for c in cs if c.predicted),
                     prediction_rejected=sum(c.predicted.rejected for c in cs if c.predicted),
                     decode_steps=sum(c.steps for c in cs))
