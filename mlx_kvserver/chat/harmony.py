"""gpt-oss's output in the Harmony format, split as it streams: :class:`HarmonyParser`.

An answer is a run of messages, each a header and a body::

    <|channel|>analysis<|message|>reasoning...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

(without the line breaks; the prompt ends with ``<|start|>assistant``, so the first header starts
at ``<|channel|>``, or at `` to=``). A header runs to ``<|message|>`` and holds the author
(``assistant``), the channel (``<|channel|>NAME``), the recipient (``to=NAME``, before or after
the channel) and the content type (``json``, ``code``, ``<|constrain|>json``, with or without a
space before it); the body runs to ``<|end|>``, ``<|call|>`` or ``<|return|>``. The last two are
end tokens: the engine stops on them and never feeds them, so :meth:`HarmonyParser.finish`
closes the open message (fed, they end it the same way). What each message becomes:

- a message to a recipient is a tool call, on any channel: ``to=functions.NAME`` calls ``NAME``;
  another recipient (a built-in tool: ``browser.search``, ``python``) is a call named as written
  (``browser.search``: not among the offered tools, so the call carries an ``unknown_tool``
  problem). The body is the arguments, followed as JSON as it streams (:mod:`.calls`'
  ``JsonCallsReader``, :mod:`.call_events`' checks); the content type is not needed for that and
  is not read. The recipients ``assistant``, ``user`` and ``all`` are no tool (gpt-oss-20b writes
  ``<|channel|>commentary to=assistant``): such a message is read as if it had none. With no
  tools offered, calls are not looked for: the body goes where its channel says;
- ``analysis`` is reasoning; ``final``, a ``commentary`` message without a recipient (a preamble
  meant for the user) and a message with no channel are answer text. Several reasoning or text
  messages in one answer are joined by a blank line;
- a message from another author (the model went on to write a tool's reply or the next user
  turn) ends the answer there, as an end token would.

The text fed in is decoded with special tokens kept (``ChatFormat.markers_special``). Header
text never reaches the answer; a body is passed on as it comes, holding back only an end that
could still be a marker. Bad output never raises: output that does not start with a header (a
continued final message: Anthropic's prefill) is answer text; a header that runs past
:data:`MAX_HEADER` characters is no header and its text is answer text; a header cut off by
``max_tokens`` is dropped.
"""

from __future__ import annotations

import regex

from .call_events import CallTracker
from .calls import JsonCallsReader, Piece, json_objects
from .conversation import Tool
from .output import Delta, ReasoningDelta, TextDelta
from .parse import OutputParser, _first, _partial

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
RETURN, CALL = "<|return|>", "<|call|>"
MAX_HEADER = 512
NOT_TOOLS = ("assistant", "user", "all")

_ENDS = [END, CALL, RETURN, START]  # what ends a body (<|start|>: a message with no <|end|>)
_HEADER_START = regex.compile(r"\s*(?:to=|<\|channel\|>|<\|constrain\|>|<\|message\|>)")
_RECIPIENT = regex.compile(r"(?:^|\s|>)to=([^\s<]+)")
_CHANNEL = regex.compile(r"<\|channel\|>\s*([^\s<]+)")
_ROLE = regex.compile(r"\s*([^\s<]+?)(?:\s|<|$)")

# states
_FIRST, _HEADER, _BODY, _BETWEEN = "first", "header", "body", "between"
_TEXT, _REASONING, _CALL = "text", "reasoning", "call"


class HarmonyParser:
    """Splits one choice's Harmony output into deltas: feed text as it is decoded, then
    :meth:`finish`. The same interface as :class:`.parse.OutputParser`.

    ``tools``: the offered tools (with none, calls are not looked for). ``in_reasoning``: the
    prompt ended inside an analysis message. ``parallel`` False: the answer ends after its first
    call (Harmony makes one call per message and the engine stops at its ``<|call|>`` anyway).
    """

    def __init__(self, index: int, tools: list[Tool], in_reasoning: bool = False,
                 parallel: bool = True) -> None:
        self.index = index
        self.calls = CallTracker(index, tools, parallel)
        self._calls_on = bool(tools)
        self._state = _BODY if in_reasoning else _FIRST
        self._kind = _REASONING
        self._buf = ""  # text not yet decided
        self._reader: JsonCallsReader | None = None
        self._fresh = True  # the open message has passed nothing on yet
        self._role_given = not in_reasoning
        self._stopped = False  # another author's message began: the answer is over
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._after_calls = False  # text or reasoning came after the answer's last call

    # the interface's accessors, as OutputParser has them (over _text, _reasoning and calls)
    text, reasoning, tool_calls = OutputParser.text, OutputParser.reasoning, OutputParser.tool_calls
    finish_reason = OutputParser.finish_reason

    @property
    def ended(self) -> bool:
        """No more output is wanted: a call ended the answer (``parallel`` off, or a repeat), or
        the model began a message of another author."""
        return self.calls.ended or self._stopped

    @property
    def in_reasoning(self) -> bool:
        """Inside an analysis message's body (its tokens count as reasoning tokens)."""
        return self._state == _BODY and self._kind == _REASONING

    def feed(self, text: str) -> list[Delta]:
        """Take the next piece of decoded output; return the deltas it completes."""
        out: list[Delta] = []
        self._buf += text
        while self._buf and not self.ended:
            if self._state == _FIRST:
                m = _HEADER_START.match(self._buf, partial=True)
                if m is not None and m.partial:
                    break  # only whitespace or the start of a header yet
                if m is None:  # not a header: a final message's body (continued)
                    self._start_body(_TEXT)
                    self._role_given = False
                else:
                    self._state = _HEADER
            elif self._state == _HEADER:
                if not self._read_header(out):
                    break
            elif self._state == _BETWEEN:
                if not self._between():
                    break
            elif not self._body(out):
                break
        return out

    def finish(self, cut: bool = False) -> list[Delta]:
        """The output ended (``cut``: by ``max_tokens``, not by an end token): the open message
        ends here. A header is dropped; held text that can only begin a marker is dropped when
        the output was cut."""
        out: list[Delta] = []
        buf, self._buf = self._buf, ""
        if self.ended:
            return out
        if self._state == _BODY and self._kind == _CALL:
            if not cut:
                self._deliver(self._reader.feed(buf), out)
            self._close_call(out, closed=not cut)
        elif self._state == _BODY and not cut:
            self._emit(buf, out)
        elif self._state == _BETWEEN and not cut and buf.strip():
            self._start_body(_TEXT)
            self._emit(buf, out)
        self._state = _BETWEEN
        return out

    # -- internals --

    def _read_header(self, out: list[Delta]) -> bool:
        """The open header is the whole of ``_buf`` until its ``<|message|>`` arrives."""
        i = self._buf.find(MESSAGE)
        pos, hit = _first(self._buf if i < 0 else self._buf[:i], _ENDS)
        if hit is not None:  # a header with no body: dropped, the marker acted on
            self._buf = self._buf[pos + len(hit):]
            self._state = _HEADER if hit == START else _BETWEEN
            return True
        if i < 0:
            if len(self._buf) > MAX_HEADER:  # no header: answer text
                self._start_body(_TEXT)
                return True
            return False
        header, self._buf = self._buf[:i], self._buf[i + len(MESSAGE):]
        self._open(header, out)
        return True

    def _open(self, header: str, out: list[Delta]) -> None:
        if self._role_given:  # the prompt's <|start|>assistant began the first header
            self._role_given = False
        else:
            role = _ROLE.match(header)
            if role is None or role.group(1) != "assistant":
                self._stopped = True  # another author's message: the answer is over
                return
        m = _RECIPIENT.search(header)
        to = m.group(1) if m else None
        ch = _CHANNEL.search(header)
        if to is not None and to not in NOT_TOOLS and self._calls_on:
            self._start_body(_CALL)
            name = to[len("functions."):] if to.startswith("functions.") else to
            # the reader's head is the name as its own line: the call starts at once
            self._reader = JsonCallsReader(r"(?P<name>[^\n]*)\n", r"\s*", json_objects)
            self._deliver(self._reader.feed(name + "\n"), out)
        else:
            self._start_body(_REASONING if ch and ch.group(1) == "analysis" else _TEXT)

    def _start_body(self, kind: str) -> None:
        self._state, self._kind, self._fresh = _BODY, kind, True

    def _between(self) -> bool:
        self._buf = self._buf.lstrip()
        if self._buf.startswith(START):
            self._buf = self._buf[len(START):]
            self._state = _HEADER
            return True
        if not self._buf or START.startswith(self._buf):
            return False
        self._start_body(_TEXT)  # text outside any message: answer text
        return True

    def _body(self, out: list[Delta]) -> bool:
        pos, hit = _first(self._buf, _ENDS)
        if hit is None:
            keep = _partial(self._buf, _ENDS)
            self._pass_on(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._pass_on(self._buf[:pos], out)
        self._buf = self._buf[pos + len(hit):]
        if self._kind == _CALL:
            self._close_call(out, closed=True)
        self._state = _HEADER if hit == START else _BETWEEN
        return True

    def _pass_on(self, s: str, out: list[Delta]) -> None:
        if self._kind == _CALL:
            if s:
                self._deliver(self._reader.feed(s), out)
        else:
            self._emit(s, out)

    def _emit(self, s: str, out: list[Delta], kind: str | None = None) -> None:
        if not s:
            return
        kind = kind or self._kind
        parts = self._reasoning if kind == _REASONING else self._text
        if (self._fresh or kind != self._kind) and parts:
            s = "\n\n" + s  # a new message of the same kind
        if kind == self._kind:
            self._fresh = False
        parts.append(s)
        self._after_calls = True
        out.append(ReasoningDelta(self.index, s) if kind == _REASONING
                   else TextDelta(self.index, s))

    def _deliver(self, pieces: list[Piece], out: list[Delta]) -> None:
        before = len(self.calls.calls)
        deltas, back = self.calls.take(pieces)
        out += deltas
        self._after_calls = self._after_calls and len(self.calls.calls) == before
        for text in back:  # what followed the arguments in the call's body: answer text
            self._emit(text, out, _TEXT)

    def _close_call(self, out: list[Delta], closed: bool) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            self._deliver(reader.close(closed), out)

