"""What the engine sends back for a request: typed events, the same for every API.

A job's events, in order: ``Accepted`` (prompt checked, cache looked up; before any byte goes
out), then per choice ``Start``, deltas (``TextDelta``, ``ReasoningDelta``, ``ToolCallStart``,
``ToolCallDelta``) and ``Finish``; then ``Usage`` once all choices are done; last ``Done``. An
``Error`` (a ``RequestError``: ``mlx_kvserver.errors``) takes the place of what is left before
``Done``. The scheduler's ``step()`` returns them, the engine hands them to their jobs, and each
API module dispatches on their type to build its own stream or body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from ..errors import RequestError
from .conversation import ToolCall


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token: its text, id, log-probability and the ``top`` alternatives
    (``(text, id, logprob)``, most likely first)."""

    token: str
    id: int
    logprob: float
    top: tuple[tuple[str, int, float], ...] = ()


@dataclass(frozen=True)
class Accepted:
    prompt_tokens: int
    cached_tokens: int
    source: str = "none"


@dataclass(frozen=True)
class Start:
    index: int
    message_id: str


@dataclass(frozen=True)
class TextDelta:
    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ReasoningDelta:
    index: int
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A new tool call in choice ``index``: ``call`` counts the choice's calls from 0."""

    index: int
    call: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A fragment of the arguments' text of call ``call``, as the model writes it. While
    ``valid`` the fragments so far are a prefix of a JSON object; a call whose arguments stop
    being JSON goes on with ``valid`` False fragments (the text as written)."""

    index: int
    call: int
    arguments: str
    valid: bool = True


@dataclass(frozen=True)
class ToolCallEnd:
    """Call ``call`` is complete (its last delta came before). ``problem``: what was wrong with
    it (``chat/call_events.py``), None when nothing was. ``call`` is -1 for a call block that
    held no call (``problem`` says why; its text, if any, went to the answer)."""

    index: int
    call: int
    problem: str | None = None


Delta = Union[TextDelta, ReasoningDelta, ToolCallStart, ToolCallDelta, ToolCallEnd]


@dataclass(frozen=True)
class Finish:
    """A choice's end: ``reason`` is ``stop``, ``length`` or ``tool_calls``; ``text`` the answer
    (reasoning and tool calls apart), ``logprobs`` those of the answer's tokens when asked."""

    index: int
    reason: str
    message_id: str
    text: str
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    stop_sequence: str | None = None
    tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class Divergence:
    """Where a prompt first differs from a history the engine held (``divergence.py``)."""

    position: int  # the first prompt token that differs from the held history
    message_index: int | None  # the message that token belongs to (None: not found)
    prompt_excerpt: str
    cached_excerpt: str
    reread_tokens: int  # tokens of the held history after the difference, read again

    def as_dict(self) -> dict:
        return {"position": self.position, "message_index": self.message_index,
                "prompt_excerpt": self.prompt_excerpt, "cached_excerpt": self.cached_excerpt,
                "reread_tokens": self.reread_tokens}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    divergence: Divergence | None = None  # why prompt tokens were read again, when they were
    reasoning_tokens: int = 0  # of the completion tokens, those inside reasoning
    # draft tokens speculative decoding verified (every source: the sequence, the cache, a draft
    # model, a grammar, a prediction) that the answer took / did not take
    draft_accepted: int = 0
    draft_rejected: int = 0
    # the client's prediction (OpenAI's Predicted Outputs): its tokens that appeared in the
    # completion / that did not (engine/speculation/prediction.py); 0 and 0 without one
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    decode_steps: int = 0  # forward passes that produced the completion after its first token

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Error:
    """The request failed: nothing more comes but ``Done``."""

    error: RequestError


@dataclass(frozen=True)
class Done:
    """A job's last event: the engine holds nothing of it any more."""


Event = Union[Accepted, Start, Delta, Finish, Usage, Error, Done]


@dataclass
class Answer:
    """A whole choice gathered from its events (what a non-streaming response reports)."""

    index: int
    message_id: str = ""
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stop_sequence: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
