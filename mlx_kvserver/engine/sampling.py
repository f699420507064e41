"""Choosing a choice's next token: stop strings, temperature / top-p / top-k sampling from a key
of its own, an optional grammar mask, and the sampled tokens' log-probabilities."""

from __future__ import annotations

import random
from typing import Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from ..chat.conversation import Sampling
from ..chat.output import TokenLogprob


class StopMatcher:
    """Finds stop strings in streamed text and says how much text is safe to emit."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, since: int) -> int:
        """Index of the earliest stop string in ``text`` (searching near ``since``), or -1."""
        hit = self.match(text, since)
        return hit[0] if hit else -1

    def match(self, text: str, since: int) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in ``text``, or None."""
        start = max(0, since - self.longest)
        hits = [(i, s) for s in self.stops if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def safe_end(self, text: str) -> int:
        """Text up to this index cannot become part of a stop string."""
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return len(text) - k
        return len(text)


class Sampler:
    """Temperature, top-p and top-k sampling with mlx-lm's filters, drawing from a random key of
    its own: a seeded choice draws the same tokens whether it runs alone or in a batch (choice
    ``i`` of a request seeds with ``seed + i``). A grammar ``matcher`` (``chat.constraints``)
    masks the tokens it does not allow before anything else."""

    def __init__(self, params: Sampling, index: int = 0, matcher=None):
        self.temperature, self.top_p, self.top_k = params.temperature, params.top_p, params.top_k
        seed = params.seed + index if params.seed is not None else random.getrandbits(62)
        self.key = mx.random.key(seed)
        self.matcher = matcher

    def __call__(self, logits: mx.array) -> mx.array:
        """A token (lazy) from one row of logits."""
        if self.matcher is not None:
            logits = self.matcher.apply(logits)
        if self.temperature == 0:
            return mx.argmax(logits, axis=-1)
        logprobs = self._logprobs(logits)
        self.key, draw = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1 / self.temperature), key=draw)

    def verify(self, logits: mx.array, draft: int) -> int:
        """The token at a draft position: a token ``y`` drawn from ``p`` (this sampler's
        distribution, grammar mask included) with the very key plain sampling would use; the
        draft is kept when ``y`` is it. That keeps ``draft`` with probability ``p(draft)`` and
        otherwise gives a token drawn from ``p`` without it, renormalized (the rule of Leviathan
        et al. and Chen et al. 2023 for a draft that is one fixed token), and a seeded answer is
        the one it is without drafts, whatever the drafts were."""
        return int(self(logits).item())

    def _logprobs(self, logits: mx.array) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if 0 < self.top_k < logprobs.shape[-1]:  # top_k >= the vocabulary: all of it
            logprobs = apply_top_k(logprobs[None], self.top_k)[0]
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs[None], self.top_p)[0]
        return logprobs

    def advance(self, token: int) -> None:
        if self.matcher is not None:
            self.matcher.advance(token)

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more (the choice ends here)."""
        return self.matcher is not None and self.matcher.finished


def token_logprob(logits: mx.array, token: int, top: int, decode) -> TokenLogprob:
    """The log-probability of ``token`` under one row of the model's logits (before any grammar
    mask or temperature, as OpenAI reports them) and the ``top`` most likely tokens."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, keepdims=True)
    alts: tuple = ()
    if top > 0:
        ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
        vals = logprobs[ids]
        mx.eval(ids, vals)
        pairs = sorted(zip(ids.tolist(), vals.tolist()), key=lambda p: -p[1])
        alts = tuple((decode([i]), i, v) for i, v in pairs)
    return TokenLogprob(decode([token]), token, logprobs[token].item(), alts)
