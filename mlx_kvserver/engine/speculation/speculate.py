"""Speculative decoding inside the running batch: :class:`Speculation`.

Each decode step, every running choice may bring a draft (a grammar's forced tokens first, they
cannot fail; else ``drafts.py``: a client's prediction, prompt lookup over its own tokens, other
saved entries' tokens, whichever agrees with the answer's last tokens; else a draft model's). One
forward pass then verifies them all (``Runner.verify``): each sequence feeds its last sampled
token and its draft, drafts of different lengths side by side with choices that have none, and
the logits of every position come back. Each choice takes its own:

- greedy: the longest prefix of the draft where the model's argmax is the draft's token, then the
  model's own token (a correction, or one more when the whole draft was taken);
- sampling: draft token ``x`` is kept with probability ``p(x)`` (``p`` after the grammar mask,
  temperature, top-k and top-p), else the token is drawn from ``p`` without ``x``, renormalized
  (``Sampler.verify``), so the answer's distribution is that of plain decoding.

Tokens go through ``Choice.accept`` one by one, so stop strings, ``max_tokens``, logprobs,
grammars and streaming see them as if decoded singly. The positions of the rejected draft tokens
are trimmed off the sequence before anything is committed to pages (they live only in its
private working buffers, never in a page another sequence shares). A model with recurrent state
(which cannot rewind) decodes without speculation, and the log says so.

Each choice counts the draft tokens it verified and took, from every source (usage's
``accepted_draft_tokens`` / ``rejected_draft_tokens``, the stats' ``drafted`` / ``accepted``).
How much of a client's prediction the answer matched is another count, kept whether or not
anything was drafted (``prediction.py``: OpenAI's ``accepted_prediction_tokens``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from ...chat.output import Delta
from .drafts import Drafter, SharedIndex
from .pass_cost import PassCost
from ..request import Choice

log = logging.getLogger("mlx_kvserver.engine")

MODES = ("off", "ngram", "draft")


@dataclass
class SpeculationStats:
    """Per model: ``steps`` forward passes that decoded answers, ``tokens`` they produced,
    ``drafted`` / ``accepted`` draft tokens (by source in ``sources``)."""

    steps: int = 0
    tokens: int = 0
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def as_dict(self) -> dict:
        return {"decode_steps": self.steps, "tokens": self.tokens,
                "verify_steps": self.verify_steps, "drafted": self.drafted,
                "accepted": self.accepted,
                "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                "tokens_per_step": round(self.tokens / self.steps, 4) if self.steps else 0.0}


class Speculation:
    """Drafts and their verification for one model's scheduler. ``mode``: ``off``, ``ngram``
    (drafts from token ids the server holds) or ``draft`` (a draft model, where one is given);
    ``max_draft``: the most draft tokens per step of one sequence."""

    def __init__(self, runner, mode: str = "ngram", max_draft: int = 8,
                 can_rewind: bool = True, name: str = "model", draft=None) -> None:
        if mode not in MODES:
            raise ValueError(f"speculate must be one of {', '.join(MODES)}, not {mode!r}")
        self.runner, self.max_draft = runner, max(0, int(max_draft))
        self.mode = mode if self.max_draft else "off"
        self.draft = draft if self.mode == "draft" else None  # draft_model.DraftModel
        if self.mode == "draft" and draft is None:
            log.info("%s drafts from its token ids only: no draft model fits it", name)
            self.mode = "ngram"
        if self.mode != "off" and not can_rewind:
            log.info("%s decodes without speculation: its recurrent state cannot go back to "
                     "a rejected draft's position", name)
            self.mode = "off"
        self.shared = SharedIndex() if self.mode != "off" else None
        self.stats = SpeculationStats()
        self.cost = PassCost()
        self._offered: dict[int, list[int]] = {}  # this step's drafts that were cut by cost

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def saved(self, tokens: Sequence[int]) -> None:
        """An entry was saved: its token ids become a draft source for everyone."""
        if self.shared is not None:
            self.shared.add(tokens)

    # -- drafts ---------------------------------------------------------------------------------

    def drafts(self, group: Sequence[Choice]) -> list[list[int]]:
        """Each choice's draft for this step (empty where it has none): from the token ids the
        server holds, else (``draft`` mode) from the draft model, all of them in one go."""
        if not self.on:
            return [[] for _ in group]
        out, wants = [], []
        for i, c in enumerate(group):
            d, room = self._draft(c)
            out.append(d)
            if not d and room > 0 and self.draft is not None and not c.drafter.pause:
                wants.append((i, c, min(room, c.drafter.length)))
        if wants:
            proposed = self.draft.propose([(c, _without_images(c), k) for _, c, k in wants])
            for (i, c, _), d in zip(wants, proposed):
                m = c.sampler.matcher
                out[i] = d[:m.valid_prefix(d)] if d and m is not None else d
                c.draft_source = "model" if out[i] else ""
        lengths = self._lengths(group, out)
        if log.isEnabledFor(logging.DEBUG) and any(out):
            log.debug("drafts offered %s (rates %s), verified %s", [len(d) for d in out],
                      [round(c.drafter.rate, 2) if c.drafter else None for c in group], lengths)
        # NOTE: draft tokens cut by cost get no verify pass, so a drafter would learn nothing
        # of them and keep a draft too short or a rate too low to pay (seen: 16 steps on a
        # one-token draft until the next probe; a tail answer copying its file whole verified
        # 1, 1, 1, 2, 3, 5 of 8 offered while its rate climbed back). The first token past what
        # is verified (here, or by the scheduler's memory bound after) is checked against the
        # token the step gives at that position instead (a plain step's token; a verify pass's
        # token after a draft taken whole): free, and for a sampled answer the chance of a match
        # is the chance it would have been kept. Every draft offered is kept for it, also one
        # verified whole here: the memory bound may cut it after
        self._offered = {id(c): d for c, d in zip(group, out)
                         if d and c.draft_source not in ("", "grammar")}
        return [d[:n] for d, n in zip(out, lengths)]

    def _lengths(self, group: Sequence[Choice], drafts: list[list[int]]) -> list[int]:
        """How many of each choice's draft tokens this step verifies (all 0: a plain decode
        step): its draft up to the step's width (``_width``). Measured on this CPU, one width
        for all did better than each answer its own length by its expected gain: eight `edit`
        clients 1.43-1.51x against 1.30x (earlier runs of benchmarks/speculation.py, in
        docs/BENCHMARKS.md's git history); a ragged pass
        (``Runner.pass_rows``) still costs only the rows of the drafts that are shorter."""
        w = self._width(group, drafts)
        return [min(len(d), w - 1) for d in drafts]

    def _width(self, group: Sequence[Choice], drafts: list[list[int]]) -> int:
        """The step's width (1: a plain decode step): the one that gives the most tokens per
        second, by each choice's recent acceptance and what a pass that wide costs against a
        plain step here (``PassCost``), at the rows it will have (``_rows``: ragged, a choice
        without a draft is one row however wide the step). A choice whose draft is forced (a
        grammar) counts every token as taken. Where no width pays, a wide pass is still tried
        now and then (``PassCost.probe_due``), so a cost measured once is measured again."""
        longest = max((len(d) for d in drafts), default=0)
        if longest == 0:
            return 1
        B = len(group)
        best, best_rate, wide, wide_rate = 1, float(B), 2, 0.0
        for w in range(2, longest + 2):
            gain = sum(min(len(d), w - 1) + 1 if c.draft_source == "grammar"
                       else c.drafter.expected(min(len(d), w - 1)) if d else 1.0
                       for c, d in zip(group, drafts))
            rows = self._rows([1 + min(len(d), w - 1) for d in drafts])
            rate = gain / self.cost.relative(B, rows)
            if rate > wide_rate * 1.02:
                wide, wide_rate = w, rate
        if wide_rate > best_rate * 1.02:
            best = wide
        if self.cost.probe_due(B, declined=best == 1):
            best = wide
        return best

    def _rows(self, lengths: list[int]) -> int:
        """The token rows of a pass over pieces of ``lengths``, as the runner will run it
        (ragged or padded: ``Runner.pass_rows``) and as ``verify`` tells ``self.cost`` after."""
        if self.runner is None:
            return len(lengths) * max(lengths)
        return self.runner.pass_rows(lengths)

    def _draft(self, c: Choice) -> tuple[list[int], int]:
        """(a draft from what the server holds, the room for one)."""
        r = c.request
        if not r.speculate or c.next_token is None:
            return [], 0
        room = min(r.max_tokens - len(c.tokens), r.lm.context_length - len(c.seq.tokens)) - 1
        if room <= 0:
            return [], 0
        c.draft_source = ""
        m = c.sampler.matcher
        if m is not None:  # what the grammar forces is a draft that cannot fail
            forced = m.forced_tokens()[:min(room, self.max_draft)]
            if forced:
                c.draft_source = "grammar"
                return forced, room
        drafter = self._drafter(c)
        paused = drafter.pause > 0
        d = drafter.propose(room)
        if d and m is not None:
            d = d[:m.valid_prefix(d)]  # never verify what the grammar would refuse
        c.draft_source = drafter.source if d else ""
        return d, (0 if paused else room)

    def release(self, c: Choice, key: str | None = None) -> None:
        """``c`` is done (``key``: its answer's id, where its cache is saved) or dropped."""
        if self.draft is not None:
            self.draft.finished(c, key)

    def _drafter(self, c: Choice) -> Drafter:
        r = c.request
        if c.drafter is None:
            c.drafter = Drafter(list(r.prompt), self.max_draft, r.prediction, self.shared)
        ctx = c.drafter.context
        missing = len(r.prompt) + len(c.tokens) - len(ctx)
        if missing > 0:
            ctx.extend(c.tokens[len(c.tokens) - missing:])
        return c.drafter

    # -- verification ---------------------------------------------------------------------------

    def verify(self, group: Sequence[Choice],
               drafts: Sequence[list[int]]) -> list[list[Delta]]:
        """One forward pass over each choice's last token and draft; each takes what it may.
        Returns each choice's deltas (a choice may be done after it)."""
        pieces = [[c.next_token, *d] for c, d in zip(group, drafts)]
        t0 = time.perf_counter()
        rows = self.runner.verify([c.seq for c in group], pieces)
        plain = [c.sampler.temperature == 0 and c.sampler.matcher is None for c in group]
        argmax = [mx.argmax(lg, axis=-1) if p else None for lg, p in zip(rows, plain)]
        mx.eval([a for a in argmax if a is not None] or rows)
        seconds = time.perf_counter() - t0
        self.cost.add(len(group), self._rows([len(p) for p in pieces]), seconds)
        out, made = [], 0
        self.stats.steps += 1
        self.stats.verify_steps += 1
        for c, d, lg, am in zip(group, drafts, rows, argmax):
            greedy = am.tolist() if am is not None else None
            deltas: list[Delta] = []
            taken, j, before = 0, 0, len(c.tokens)
            for j in range(len(d) + 1):
                if greedy is not None:
                    t = greedy[j]
                elif j < len(d):
                    t = c.sampler.verify(lg[j], d[j])
                else:
                    t = int(c.sample(lg[j]).item())
                deltas += c.accept(t, lg[j])
                if c.done or j == len(d) or t != d[j]:
                    break
                taken += 1
            if len(d) > j:  # the rejected draft's positions, off the private tail
                c.seq.trim(len(d) - j)
            # the token after a draft taken whole, against the next one of the draft offered
            offered = self._offered.pop(id(c), ())
            past = t == offered[j] if taken == j == len(d) < len(offered) else None
            self._count(c, d, taken, len(c.tokens) - before, past)
            made += len(c.tokens) - before
            out.append(deltas)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("verify pass: %d sequences, drafts %s, %.0f ms, %d tokens",
                      len(group), [len(d) for d in drafts], seconds * 1e3, made)
        return out

    def decoded(self, group: Sequence[Choice], seconds: float,
                tokens: Sequence[int] = ()) -> None:
        """A plain decode step of ``group`` (one token each, ``tokens``) that took ``seconds``;
        a draft declined for it is scored by its first token (``drafts``)."""
        self.cost.add(len(group), len(group), seconds)
        log.debug("plain step: %d sequences, %.0f ms", len(group), seconds * 1e3)
        for c, t in zip(group, tokens):
            offered = self._offered.pop(id(c), None)  # a draft declined whole (``drafts``)
            if offered and c.drafter is not None:
                c.drafter.taken(1, int(t == offered[0]))
        self.stats.steps += 1
        self.stats.tokens += len(group)
        for c in group:
            c.steps += 1

    def _count(self, c: Choice, draft: list[int], taken: int, produced: int,
               past: bool | None = None) -> None:
        """A verify pass's outcome for ``c``; ``past``: whether the token after its draft
        (taken whole) was the next one of the draft cut by cost, where there was one: the
        drafter learns of it as of one more token verified."""
        s = self.stats
        s.tokens += produced
        s.drafted += len(draft)
        s.accepted += taken
        c.steps += 1
        c.drafted += len(draft)
        c.accepted += taken
        if c.drafter is not None and c.draft_source not in ("", "grammar"):
            c.drafter.taken(len(draft) + (past is not None), taken + bool(past))


def _without_images(c: Choice) -> list[int]:
    """What a draft model reads of ``c``: its prompt and answer with each image's tokens left
    out. A draft model sees no pixels (it runs text only), so an image's tokens would be read as
    that many copies of a placeholder token; the text around the image is what it can draft
    from."""
    ctx, spans = c.drafter.context, getattr(c.request, "spans", ())
    if not spans:
        return ctx
    out, at = [], 0
    for s in spans:
        out += ctx[at:s.start]
        at = s.end
    return out + ctx[at:]
