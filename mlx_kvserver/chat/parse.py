"""A choice's generated text split, as it streams, into reasoning, answer text and tool calls.

:class:`OutputParser` scans for the format's markers (``<think>``/``</think>``, the call
markers) and holds back only text that could still be the start of one, as a stop-string matcher
does. A call's body is parsed when it is complete:

- mlx-lm's parser modules (``mlx_lm/tool_parsers/<name>.parse_tool_call(body, tools)``) for every
  format they cover: json_tools (hermes), qwen3_coder (XML), mistral (``[TOOL_CALLS]``, both the
  JSON list and ``name[ARGS]{...}``), pythonic, glm47, minimax_m2, kimi, gemma4, ...; what they
  return is checked and normalised here (a name, arguments that are a JSON object);
- our own code for our fallback (``<tool_call>`` JSON, through mlx-lm's json_tools parser) and
  for Llama 3.x's bare ``{"name": ..., "parameters": {...}}`` calls (``llama3_json``: the answer
  starts with ``{`` or ``<|python_tag|>``, calls separated by ``;``), which mlx-lm has no parser
  for; and the streaming itself, since mlx-lm's server splits text per token state and parses
  only after a call's end.

A call is emitted when its body is complete, as ``ToolCallStart`` and one ``ToolCallDelta``
with all of its arguments (``json.dumps`` of the parsed object, so the deltas of a call equal its
``ToolCall.arguments``). Formats without an end marker (mistral, llama3_json) emit their calls
at :meth:`OutputParser.finish`. A body that does not parse is given back as answer text, markers
included. Whitespace around think blocks and calls is dropped (``<think>\\n...\\n</think>\\n\\n``
gives the reasoning and the answer without those newlines).

The text fed in must keep the markers: where a marker is a special token
(``ChatFormat.markers_special``: Mistral's ``[TOOL_CALLS]``, LFM2's ``<|tool_call_start|>``,
Llama's ``<|python_tag|>``) the caller decodes with special tokens kept. Qwen's ``<think>`` and
``<tool_call>`` are added tokens that are not special: a plain decode keeps them.
gpt-oss's harmony format is not parsed.
"""

from __future__ import annotations

import importlib
import json
import secrets
from typing import Any, Callable

from .conversation import Tool, ToolCall
from .formats import FALLBACK, LLAMA3_JSON, ChatFormat
from .output import Delta, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallStart
from .render import hf_tool

_TEXT, _REASONING, _CALL = "text", "reasoning", "call"


def new_call_id() -> str:
    """A fresh tool-call id, ``call_<24 hex digits>``."""
    return f"call_{secrets.token_hex(12)}"


class OutputParser:
    """Splits one choice's output into deltas: feed text as it is decoded, then :meth:`finish`.

    ``tools`` are the offered tools (used to type qwen3_coder's arguments); with none, calls are
    not looked for and call markers stay text. ``in_reasoning``: the prompt ended inside an open
    think block, so the output starts as reasoning.
    """

    def __init__(self, fmt: ChatFormat, index: int, tools: list[Tool],
                 in_reasoning: bool = False) -> None:
        self.fmt, self.index = fmt, index
        self._calls_on = bool(tools) and bool(fmt.call_start or fmt.tool_parser == LLAMA3_JSON)
        self._thinks = bool(fmt.think_start and fmt.think_end)
        self._parse = _body_parser(fmt, [hf_tool(t) for t in tools])
        self._state = _REASONING if in_reasoning and self._thinks else _TEXT
        self._buf = ""  # text not yet decided (it could begin a marker)
        self._ws = ""  # whitespace held at the end of the text or reasoning
        self._strip = self._state == _REASONING  # drop the next segment's leading whitespace
        self._opener = self._body = self._call_ws = ""
        self._bare_json = self._calls_on and fmt.tool_parser == LLAMA3_JSON
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCall] = []

    @property
    def text(self) -> str:
        """The answer text so far (reasoning and calls apart)."""
        return "".join(self._text)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls)

    def feed(self, text: str) -> list[Delta]:
        """Take the next piece of decoded output; return the deltas it completes."""
        out: list[Delta] = []
        self._buf += text
        while self._buf:
            if self._bare_json and self._state == _TEXT and not self._started():
                body = self._buf.lstrip()
                if not body:
                    break  # only whitespace yet: the answer may still start with a call
                self._bare_json = False
                if body[0] == "{":
                    self._call_ws, self._opener = self._buf[:len(self._buf) - len(body)], ""
                    self._state, self._body, self._buf = _CALL, "", body
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

    def finish(self) -> list[Delta]:
        """The output ended: flush what was held back; a call left open is parsed if its body
        is complete, else given back as text."""
        out: list[Delta] = []
        buf, self._buf = self._buf, ""
        self._emit(buf, out)
        if self._state == _CALL:
            self._end_call(out, closed=False)
        if self._state == _TEXT and self._ws:
            self._add_text(self._ws, out)
        self._ws = ""
        return out

    # -- internals --

    def _started(self) -> bool:
        return bool(self._text or self._ws or self._calls)

    def _markers(self) -> list[str]:
        f, calls = self.fmt, self._calls_on
        if self._state == _CALL:
            return [f.call_end] if f.call_end else ([f.call_start] if f.call_start else [])
        ms = [f.think_start if self._state == _TEXT else f.think_end] if self._thinks else []
        return ms + ([f.call_start] if calls and f.call_start else [])

    def _switch(self, marker: str, out: list[Delta]) -> None:
        f = self.fmt
        if self._state == _CALL:
            self._end_call(out, closed=True)
            if marker == f.call_start and not f.call_end:  # a no-end format's next call
                self._state, self._opener, self._call_ws = _CALL, marker, ""
        elif marker == f.call_start:
            self._call_ws, self._ws = self._ws, ""
            self._state, self._opener, self._body = _CALL, marker, ""
        elif self._state == _TEXT:  # think_start
            self._state, self._ws, self._strip = _REASONING, "", True
        else:  # think_end
            self._state, self._ws, self._strip = _TEXT, "", True

    def _emit(self, s: str, out: list[Delta]) -> None:
        if self._state == _CALL:
            self._body += s
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
            out.append(ReasoningDelta(self.index, piece))
        else:
            self._add_text(piece, out)

    def _add_text(self, piece: str, out: list[Delta]) -> None:
        self._text.append(piece)
        out.append(TextDelta(self.index, piece))

    def _end_call(self, out: list[Delta], closed: bool) -> None:
        """The call's body is complete (``closed``: its end marker was seen): emit it."""
        body, self._body, self._state = self._body, "", _TEXT
        try:
            calls = self._parse(body)
        except Exception:  # noqa: BLE001 - a malformed call is given back, never a crash
            calls = None
        if not calls:
            end = (self.fmt.call_end or "") if closed else ""
            self._add_text(self._call_ws + self._opener + body + end, out)
            self._call_ws, self._strip = "", False
            return
        for name, args in calls:
            n, cid = len(self._calls), new_call_id()
            self._calls.append(ToolCall(cid, name, args))
            out += [ToolCallStart(self.index, n, cid, name), ToolCallDelta(self.index, n, args)]
        self._call_ws, self._strip = "", True


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


Parsed = list[tuple[str, str]]  # (name, arguments JSON)


def _body_parser(fmt: ChatFormat, tools: list[dict]) -> Callable[[str], Parsed]:
    if fmt.tool_parser == LLAMA3_JSON:
        return _llama3_calls
    name = "json_tools" if fmt.tool_parser == FALLBACK else fmt.tool_parser
    try:
        mod = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    except ImportError:
        mod = importlib.import_module("mlx_lm.tool_parsers.json_tools")
    return lambda body: _normalise(mod.parse_tool_call(body, tools))


def _normalise(parsed: Any) -> Parsed:
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"not a tool call: {item!r}")
        args = item.get("arguments", item.get("parameters"))
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise ValueError(f"arguments are not an object: {args!r}")
        calls.append((item["name"], json.dumps(args, ensure_ascii=False)))
    if not calls:
        raise ValueError("no tool call")
    return calls


def _llama3_calls(body: str) -> Parsed:
    """``{"name": ..., "parameters": {...}}`` objects, separated by ``;``."""
    dec, items, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
        if i == len(body):
            break
        obj, i = dec.raw_decode(body, i)
        if not isinstance(obj, dict) or not ({"parameters", "arguments"} & obj.keys()):
            raise ValueError("not a tool call")
        items.append(obj)
    return _normalise(items)
