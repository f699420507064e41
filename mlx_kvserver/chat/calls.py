"""Reading the body of a tool-call block as it streams, per format: :func:`reader_for`.

:class:`.parse.OutputParser` finds a block's markers; what is between them goes to a reader,
which turns it into :data:`Piece` values as the text arrives: a call's :class:`Name`, its
arguments' JSON text in :class:`Args` fragments (token by token, not at the block's end), and
its :class:`End` (with a problem, when there was one). A block may hold several calls.

- :class:`JsonCallsReader`: the arguments are JSON in the text (hermes ``<tool_call>`` JSON, our
  fallback, Llama 3.x, Mistral's ``[TOOL_CALLS]`` list and ``name[ARGS]{...}``, Kimi K2,
  DeepSeek V3/V3.1): a head pattern per call gives the name, the arguments go through
  :class:`.jsonstream.JsonPrefix` as the model writes them (control characters in strings
  escaped), a tail pattern ends the call. A head that does not fit (keys in another order)
  falls back to parsing the rest whole at the block's end.
- :class:`.xml_calls.XmlCallsReader`: parameters as tags (Qwen3-Coder / Qwen3.5-3.6, GLM 4.5-4.7,
  MiniMax M2), typed by the tool's schema; string values stream character by character.
- :class:`.xml_calls.Gemma4Reader`: Gemma 4's ``call:name{key:<|"|>...<|"|>}``, translated to
  JSON as it streams.
- :class:`WholeReader`: every other mlx-lm format (pythonic, ...), parsed when the block ends.

:func:`.readers.reader_for` picks the reader of a format.

A reader never raises: what it cannot read is an :class:`End` with a problem, or
:class:`Unparsed` (a closed block with no call in it: its text goes back to the answer), or
:class:`Dropped` (a block cut off by ``max_tokens`` before a name: nothing to call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Union

import regex

from .formats import mlx_tool_parser
from .jsonstream import JsonPrefix


@dataclass(frozen=True)
class Name:
    name: str


@dataclass(frozen=True)
class Args:
    """A fragment of the current call's arguments; ``valid`` False: the text as the model wrote
    it after the point where it stopped being JSON."""

    text: str
    valid: bool = True


@dataclass(frozen=True)
class End:
    problem: str | None = None  # "truncated", "invalid_json: ...", ...


@dataclass(frozen=True)
class Unparsed:
    text: str


@dataclass(frozen=True)
class Dropped:
    text: str


Piece = Union[Name, Args, End, Unparsed, Dropped]
WholeParser = Callable[[str], list[tuple[str, Any]]]  # body -> [(name, arguments object)]


class CallReader:
    """The interface: :meth:`feed` the block's text as it arrives, then :meth:`close` (``closed``:
    the block's end marker, or for formats without one the output's end token, was seen;
    False: the output was cut off)."""

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def close(self, closed: bool) -> list[Piece]:
        raise NotImplementedError


class WholeReader(CallReader):
    """The block parsed when it ends, by ``parse`` (an mlx-lm parser module's)."""

    def __init__(self, parse: WholeParser, prefix: str = "") -> None:
        self.parse, self.body = parse, prefix

    def feed(self, text: str) -> list[Piece]:
        self.body += text
        return []

    def close(self, closed: bool) -> list[Piece]:
        return whole_pieces(self.parse, self.body, closed)


def whole_pieces(parse: WholeParser, body: str, closed: bool) -> list[Piece]:
    if not body.strip():
        return []
    try:
        calls = parse(body)
    except Exception:  # noqa: BLE001 - a model's text: any parser error is a non-call
        calls = []
    if not calls:
        return [Unparsed(body) if closed else Dropped(body)]
    out: list[Piece] = []
    for name, args in calls:
        if isinstance(args, dict):
            out += [Name(name), Args(json.dumps(args, ensure_ascii=False)), End()]
        else:
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            out += [Name(name), Args(text, valid=False),
                    End("invalid_json: the arguments are not a JSON object")]
    return out


# states of JsonCallsReader
_HEAD, _ARGS, _BROKEN, _TAIL, _DRAIN, _WHOLE = range(6)


class JsonCallsReader(CallReader):
    """Calls whose arguments are JSON text: ``head`` (a ``regex`` pattern with a group ``name``,
    or ``jname`` for a name written as a JSON string) precedes each call's arguments, ``tail``
    follows them. ``multi``: a block may hold several calls (each head may begin with its
    separator). ``whole`` parses what does not fit the patterns, at the block's end."""

    def __init__(self, head: str, tail: str, whole: WholeParser, multi: bool = False,
                 rest: str = r"\s*") -> None:
        self.head, self.tail = regex.compile(head, regex.DOTALL), regex.compile(tail, regex.DOTALL)
        self.rest = regex.compile(rest, regex.DOTALL)  # what may follow the last call
        self.whole, self.multi = whole, multi
        self.buf = ""
        self.state = _HEAD
        self.json: JsonPrefix | None = None
        self.quoted: str | None = None  # arguments written as a JSON string, as read so far
        self.problem: str | None = None
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while self.buf:
            st = self.state
            if st in (_DRAIN, _WHOLE):
                break
            if st == _BROKEN:  # the text as written (whitespace at its end held: a separator)
                core = self.buf.rstrip()
                if core:
                    out.append(Args(core, valid=False))
                self.buf = self.buf[len(core):]
                break
            if st == _HEAD:
                m = self.head.match(self.buf, partial=True)
                if m is None:
                    if not (self.calls and self.rest.fullmatch(self.buf, partial=True)):
                        self.state = _WHOLE  # not the pattern: parsed whole at the end
                    break
                if m.partial:
                    break
                name = m.group("name") if "name" in self.head.groupindex and m.group("name") \
                    else _json_string(m.group("jname"))
                self.buf = self.buf[m.end():]
                self.state, self.json, self.quoted = _ARGS, None, None
                out.append(Name(name.strip()))
                continue
            if st == _ARGS:
                if self.json is None:
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        break
                    # arguments written as a JSON string holding the object: read it whole
                    self.quoted = "" if self.buf[0] == '"' else None
                    self.json = JsonPrefix(require_object=self.quoted is None)
                text_out, used = self.json.feed(self.buf)
                if self.quoted is not None:
                    self.quoted += text_out
                    if self.json.done:
                        out.append(_unquoted(self.quoted))
                elif text_out:
                    out.append(Args(text_out))
                self.buf = self.buf[used:]
                if self.json.error:
                    self.problem = f"invalid_json: {self.json.error}"
                    self.state, self.buf = _BROKEN, self.json.held + self.buf
                    continue
                if self.json.done:
                    self.state = _TAIL
                    continue
                break
            # _TAIL
            m = self.tail.match(self.buf, partial=True)
            if m is not None and m.partial:
                break
            if m is not None:
                self.buf = self.buf[m.end():]
            out.append(End())
            self.calls += 1
            self.state = _HEAD if self.multi and m is not None else _DRAIN
        return out

    def close(self, closed: bool) -> list[Piece]:
        st, out = self.state, []
        if st == _ARGS and self.json is None:
            out.append(End("truncated" if not closed else "invalid_json: no arguments"))
        elif st == _ARGS:
            tail = self.json.finish()
            if tail:
                out.append(Args(tail))
            if self.quoted is not None and not self.json.done:
                out.append(Args(self.quoted + self.json.pending, valid=False))
                out.append(End("truncated" if not closed else "invalid_json: the arguments "
                               "end before they are complete"))
            elif self.json.done:
                st = _TAIL
            else:
                if self.json.pending:
                    out.append(Args(self.json.pending, valid=False))
                out.append(End("truncated" if not closed else
                               "invalid_json: the arguments end before they are complete"))
        elif st == _BROKEN:
            out.append(End(self.problem))
            self.buf = ""
        if st == _TAIL:
            out.append(End())
        elif st == _HEAD and self.buf.strip():
            if self.rest.fullmatch(self.buf) is None:
                out += whole_pieces(self.whole, self.buf, closed)
        elif st == _WHOLE and self.calls:  # after the calls: more calls, parsed whole, or text
            rest = self.buf.lstrip(" \t\r\n;,")
            pieces = whole_pieces(self.whole, rest, closed) if rest.strip() else []
            if any(isinstance(p, (Unparsed, Dropped)) for p in pieces):
                rest = self.buf[self.rest.match(self.buf).end():]
                pieces = [Unparsed(rest)] if rest.strip() else []
            out += pieces
        elif st == _WHOLE:
            out += whole_pieces(self.whole, self.buf, closed)
        elif st == _DRAIN and self.rest.fullmatch(self.buf) is None:
            out.append(Unparsed(self.buf))  # text after the last call: back to the answer
        self.buf = ""
        return out


def _unquoted(quoted: str) -> Args:
    """Arguments written as a JSON string: the text it holds (valid when that is an object)."""
    text = json.loads(quoted)
    try:
        ok = isinstance(json.loads(text), dict)
    except ValueError:
        ok = False
    return Args(text, valid=ok)


def _json_string(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


# -- the formats --------------------------------------------------------------------------------

JNAME = r'"name"\s*:\s*"(?P<jname>(?:[^"\\]|\\.)*)"'
HERMES_HEAD = r"\s*\{\s*" + JNAME + r'\s*,\s*"arguments"\s*:\s*'
OBJECT_TAIL = r"\s*\}"


def mlx_parser(module: str, tools: list[dict]) -> WholeParser:
    """The whole-body parser of mlx-lm's ``tool_parsers.<module>``, as (name, arguments)."""
    mod = mlx_tool_parser(module)

    def parse(body: str) -> list[tuple[str, Any]]:
        return normalise(mod.parse_tool_call(body, tools))
    return parse


def normalise(parsed: Any) -> list[tuple[str, Any]]:
    """mlx-lm's parse results (a dict or a list of dicts) as (name, arguments object)."""
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"not a tool call: {item!r}")
        args = item.get("arguments", item.get("parameters"))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # kept as written: a problem the caller reports
        calls.append((item["name"], {} if args is None else args))
    return calls


def json_objects(body: str) -> list[tuple[str, Any]]:
    """``{"name": ..., "arguments"|"parameters": {...}}`` objects in any key order, separated by
    whitespace, ``;`` or ``,`` and optionally inside a list (Llama 3.x, Mistral's list, hermes)."""
    dec, items, i = json.JSONDecoder(), [], 0
    body = body.strip()
    body = body[1:] if body.startswith("[") else body  # a list, or the rest of one
    body = body[:-1] if body.endswith("]") else body
    while True:
        while i < len(body) and body[i] in " \t\r\n;,":
            i += 1
        if i == len(body):
            break
        obj, i = dec.raw_decode(body, i)
        if not isinstance(obj, dict) or not ({"parameters", "arguments"} & obj.keys()):
            raise ValueError("not a tool call")
        items.append(obj)
    return normalise(items)


class MistralReader(CallReader):
    """``[TOOL_CALLS]`` followed by a JSON list of calls (v0.3) or by ``name[ARGS]{...}`` (one
    marker per call in newer models): decided by the first character that is not a space."""

    _HEADER = r"\s*(?P<name>[\w.-]+)\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\]\s*"
    _LIST = r"\s*[\[,]\s*\{\s*" + JNAME + r'\s*,\s*"arguments"\s*:\s*'

    def __init__(self, tools: list[dict]) -> None:
        self.tools = tools
        self.inner: CallReader | None = None
        self.buf = ""

    def feed(self, text: str) -> list[Piece]:
        if self.inner is None:
            self.buf += text
            if not self.buf.strip():
                return []
            if self.buf.lstrip().startswith("["):
                self.inner = JsonCallsReader(self._LIST, OBJECT_TAIL, json_objects, multi=True,
                                             rest=r"\s*\]?\s*")
            else:
                self.inner = JsonCallsReader(self._HEADER, r"\s*", mlx_parser("mistral",
                                                                              self.tools))
            text, self.buf = self.buf, ""
        return self.inner.feed(text)

    def close(self, closed: bool) -> list[Piece]:
        if self.inner is None:
            return []
        return self.inner.close(closed)


def deepseek_calls(body: str) -> list[tuple[str, Any]]:
    """DeepSeek V3 / V3.1 calls parsed whole (what the streaming patterns did not fit)."""
    pat = regex.compile(r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>([^\n]+)\n```(?:json)?\s*"
                        r"(.*?)\s*```|([^<]+?)<｜tool▁sep｜>(.*?))\s*<｜tool▁call▁end｜>",
                        regex.DOTALL)
    calls = []
    for m in pat.finditer(body):
        name, args = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        calls.append((name.strip(), json.loads(args)))
    if not calls:
        raise ValueError("no DeepSeek tool call")
    return calls
