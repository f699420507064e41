"""A choice's generated text split, as it streams, into reasoning, answer text and tool calls.

:class:`OutputParser` scans for the format's markers (``<think>``/``</think>``, the call
markers) and holds back only text that could still be the start of one, as a stop-string matcher
does. What is inside a call block goes to the format's reader (:mod:`.calls`, :mod:`.xml_calls`),
which streams each call's name and arguments as the model writes them; :mod:`.call_events` turns
that into ``ToolCallStart`` / ``ToolCallDelta`` / ``ToolCallEnd`` and checks each call.

Formats without an end marker (Mistral's ``[TOOL_CALLS]``, Llama 3.x's bare JSON, which starts
with ``{`` or ``<|python_tag|>``) end their block at the next marker or at :meth:`finish`.
Whitespace around think blocks and calls is dropped (``<think>\\n...\\n</think>\\n\\n`` gives the
reasoning and the answer without those newlines). When the output is cut off (``max_tokens``),
held text that could only be the start of a marker is dropped: no partial markup reaches the
answer.

The text fed in must keep the markers: where a marker is a special token
(``ChatFormat.markers_special``: Mistral's ``[TOOL_CALLS]``, LFM2's ``<|tool_call_start|>``,
Llama's ``<|python_tag|>``) the caller decodes with special tokens kept. Qwen's ``<think>`` and
``<tool_call>`` are added tokens that are not special: a plain decode keeps them. gpt-oss's
Harmony format has a parser of its own (:mod:`.harmony`) with the same interface.
"""

from __future__ import annotations

import logging

from .call_events import CallTracker, new_call_id
from .calls import CallReader
from .conversation import Tool, ToolCall
from .formats import LLAMA3_JSON, ChatFormat
from .output import Delta, ReasoningDelta, TextDelta
from .readers import reader_for
from .render import hf_tool

__all__ = ["OutputParser", "new_call_id"]

_TEXT, _REASONING, _CALL = "text", "reasoning", "call"
# what opens a call even without its block's opener (Qwen3-Coder models leave out <tool_call>)
BARE_OPENERS = {"qwen3_coder": "<function="}
log = logging.getLogger("mlx_kvserver.tools")


class OutputParser:
    """Splits one choice's output into deltas: feed text as it is decoded, then :meth:`finish`.

    ``tools`` are the offered tools (used to type XML formats' arguments and to check calls);
    with none, calls are not looked for and call markers stay text. ``in_reasoning``: the prompt
    ended inside an open think block, so the output starts as reasoning. ``parallel`` False: the
    answer ends after its first call (:attr:`ended`).
    """

    def __init__(self, fmt: ChatFormat, index: int, tools: list[Tool],
                 in_reasoning: bool = False, parallel: bool = True) -> None:
        self.fmt, self.index = fmt, index
        self._calls_on = bool(tools) and bool(fmt.call_start or fmt.tool_parser == LLAMA3_JSON)
        self._thinks = bool(fmt.think_start and fmt.think_end)
        self._hf_tools = [hf_tool(t) for t in tools]
        self.calls = CallTracker(index, tools, parallel)
        self._state = _REASONING if in_reasoning and self._thinks else _TEXT
        self._buf = ""  # text not yet decided (it could begin a marker)
        self._ws = ""  # whitespace held at the end of the text or reasoning
        self._strip = self._state == _REASONING  # drop the next segment's leading whitespace
        self._reader: CallReader | None = None
        self._opener = self._body = self._call_ws = ""
        self._block_calls = 0
        self._bare_json = self._calls_on and fmt.tool_parser == LLAMA3_JSON
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._after_calls = False  # text or reasoning came after the answer's last call

    @property
    def text(self) -> str:
        """The answer text so far (reasoning and calls apart)."""
        return "".join(self._text)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The answer's calls: complete, arguments a JSON object (``call_events.py``)."""
        return list(self.calls.calls)

    def finish_reason(self, reason: str) -> str:
        """The answer's finish reason, once the output ended for ``reason`` (``stop`` or
        ``length``): ``tool_calls`` when the answer holds calls and either the model ended it or
        ``max_tokens`` cut it after its last call with nothing of the answer after that call (a
        later call cut off is not part of it): the answer ends with calls a client can run."""
        if self.tool_calls and (reason == "stop" or reason == "length" and not self._after_calls):
            return "tool_calls"
        return reason

    @property
    def ended(self) -> bool:
        """No more output is wanted: a call ended the answer (``parallel`` off, or a repeat)."""
        return self.calls.ended

    @property
    def in_reasoning(self) -> bool:
        return self._state == _REASONING

    def feed(self, text: str) -> list[Delta]:
        """Take the next piece of decoded output; return the deltas it completes."""
        out: list[Delta] = []
        self._buf += text
        while self._buf and not self.ended:
            if self._bare_json and self._state == _TEXT and not self._started():
                body = self._buf.lstrip()
                if not body:
                    break  # only whitespace yet: the answer may still start with a call
                self._bare_json = False
                if body[0] == "{":
                    self._open_block("", self._buf[:len(self._buf) - len(body)])
                    self._buf = body
                    continue
            markers = self._markers()
            pos, hit = _first(self._buf, markers)
            if hit is None:
                keep = _partial(self._buf, markers)
                self._emit(self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            self._emit(self._buf[:pos], out)
            self._buf = self._buf[pos + len(hit):]
            self._switch(hit, out)
        return out

    def finish(self, cut: bool = False) -> list[Delta]:
        """The output ended (``cut``: by ``max_tokens``, not by the model): flush what was held
        back; a call block left open ends there. Held text that can only begin a marker is
        dropped when the output was cut."""
        out: list[Delta] = []
        buf, self._buf = self._buf, ""
        if not self.ended:
            if self._state == _CALL or not cut:
                self._emit(buf, out)
            if self._state == _CALL:
                self._end_block(out, closed=not cut)
        if self._state == _TEXT and self._ws:
            self._add_text(self._ws, out)
        self._ws = ""
        return out

    # -- internals --

    def _started(self) -> bool:
        return bool(self._text or self._ws or self.calls.calls)

    def _markers(self) -> list[str]:
        f, calls = self.fmt, self._calls_on
        if self._state == _CALL:
            return [f.call_end] if f.call_end else ([f.call_start] if f.call_start else [])
        # a think marker of the other kind is a stray one (dropped): a second </think>, a
        # <think> the model writes after a prompt that opened the block
        ms = [f.think_start, f.think_end] if self._thinks else []
        if calls:
            ms += [m for m in (f.call_start, BARE_OPENERS.get(f.tool_parser)) if m]
            if self._state == _TEXT and f.call_end:
                ms.append(f.call_end)  # a stray end of a call block (dropped)
        return ms

    def _switch(self, marker: str, out: list[Delta]) -> None:
        f = self.fmt
        if self._state == _CALL:
            self._end_block(out, closed=True, marker=marker)
            if marker == f.call_start and not f.call_end and not self.ended:  # no-end format
                self._open_block(marker, "")
        elif marker == f.call_start:
            self._open_block(marker, self._ws)
            self._ws = ""
        elif marker == BARE_OPENERS.get(f.tool_parser):  # a call without its block's opener
            self._open_block("", self._ws)
            self._ws = ""
            self._emit(marker, out)
        elif marker == f.think_start and self._state == _TEXT:
            self._state, self._ws, self._strip = _REASONING, "", True
        elif marker == f.think_end and self._state == _REASONING:
            self._state, self._ws, self._strip = _TEXT, "", True
        else:
            log.info("a stray %r in the output was dropped", marker)

    def _open_block(self, opener: str, ws: str) -> None:
        self._state, self._opener, self._call_ws, self._body = _CALL, opener, ws, ""
        self._reader = reader_for(self.fmt.tool_parser, self._hf_tools)
        self._block_calls = len(self.calls.calls)

    def _emit(self, s: str, out: list[Delta]) -> None:
        if self._state == _CALL:
            self._body += s
            assert self._reader is not None
            self._deliver(self._reader.feed(s), out)
            return
        if self._strip:
            s = s.lstrip()
            if not s:
                return
            self._strip = False
        core = s.rstrip()
        if not core:
            self._ws += s
            return
        piece, self._ws = self._ws + core, s[len(core):]
        if self._state == _REASONING:
            self._reasoning.append(piece)
            self._after_calls = True
            out.append(ReasoningDelta(self.index, piece))
        else:
            self._add_text(piece, out)

    def _deliver(self, pieces, out: list[Delta], end: str = "") -> None:
        before = len(self.calls.calls)
        deltas, back = self.calls.take(pieces)
        out += deltas
        self._after_calls = self._after_calls and len(self.calls.calls) == before
        for text in back:  # a block with no call in it: its text, markers included, is answer
            whole = len(self.calls.calls) == self._block_calls
            self._add_text((self._call_ws + self._opener + self._body + end) if whole else text,
                           out)
            self._call_ws = ""

    def _add_text(self, piece: str, out: list[Delta]) -> None:
        self._text.append(piece)
        self._after_calls = True
        out.append(TextDelta(self.index, piece))

    def _end_block(self, out: list[Delta], closed: bool, marker: str = "") -> None:
        """The call block ends (``closed``: its text is complete; ``marker``: the end marker
        that ended it, when one did)."""
        reader, self._reader = self._reader, None
        self._state = _TEXT
        if reader is not None:
            end = marker if marker and marker == self.fmt.call_end else ""
            self._deliver(reader.close(closed), out, end)
        # whitespace after calls is dropped at the answer's start, kept between texts
        self._call_ws = ""
        self._strip = len(self.calls.calls) > self._block_calls and not self._text


def _first(buf: str, markers: list[str]) -> tuple[int, str | None]:
    best, hit = len(buf), None
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (i < best or (i == best and hit is not None and len(m) > len(hit))):
            best, hit = i, m
    return best, hit


def _partial(buf: str, markers: list[str]) -> int:
    """Length of the longest end of ``buf`` that a marker starts with."""
    keep = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), keep, -1):
            if m.startswith(buf[-k:]):
                keep = k
                break
    return keep
