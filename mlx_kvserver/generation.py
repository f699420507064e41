"""One turn on one model: prefill the new tokens on a paged sequence, then sample and stream.

Pure model-and-cache work, no threads and no HTTP: the worker drives it and forwards its events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from kv_cache.sequence import PagedSequence

PREFILL_CHUNK = 512


class Cancelled(Exception):
    """The client went away; the turn stops where it is."""


@dataclass
class ChoiceResult:
    index: int
    message_id: str
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"


def prefill(model, seq: PagedSequence, tokens: Sequence[int],
            is_cancelled: Callable[[], bool] = lambda: False,
            chunk: int = PREFILL_CHUNK) -> mx.array:
    """Run ``tokens`` through the model on ``seq``; returns the last position's logits."""
    assert tokens, "prefill needs at least one token"
    logits = None
    for start in range(0, len(tokens), chunk):
        if is_cancelled():
            raise Cancelled()
        piece = list(tokens[start : start + chunk])
        logits = model(mx.array(piece)[None], cache=seq.layers)[:, -1, :]
        mx.eval(logits)
        seq.append_tokens(piece)
    return logits[0]


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


def decode(model, tokenizer, seq: PagedSequence, logits: mx.array, *, max_tokens: int,
           temperature: float, top_p: float, stop: Sequence[str],
           on_text: Callable[[str], None], result: ChoiceResult,
           is_cancelled: Callable[[], bool] = lambda: False) -> ChoiceResult:
    """Sample up to ``max_tokens`` tokens after ``logits``; the last sampled token's keys and
    values are not computed (the next turn's prompt supplies it)."""
    sampler = make_sampler(temp=temperature, top_p=top_p)
    eos = tokenizer.eos_token_ids
    detok = tokenizer.stream_decoder()
    stops = StopMatcher(stop)
    text, emitted, cut = "", 0, False
    for step in range(max_tokens):
        if is_cancelled():
            raise Cancelled()
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        token = int(sampler(logprobs[None]).item())
        if token in eos:
            result.finish_reason = "stop"
            break
        result.tokens.append(token)
        text += detok.add(token)
        if stops.stops:
            hit = stops.find(text, emitted)
            if hit >= 0:
                text, cut = text[:hit], True
                result.finish_reason = "stop"
                break
            end = stops.safe_end(text)
        else:
            end = len(text)
        if end > emitted:
            on_text(text[emitted:end])
            emitted = end
        if step + 1 < max_tokens:
            logits = model(mx.array([[token]]), cache=seq.layers)[0, -1, :]
            seq.append_tokens([token])
    else:
        result.finish_reason = "length"
    if not cut:
        text += detok.flush()
    if len(text) > emitted:
        on_text(text[emitted:])
    result.text = text
    return result

