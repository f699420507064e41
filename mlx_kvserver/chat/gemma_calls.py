"""Gemma 4's tool calls, ``call:NAME{key:<|"|>text<|"|>,n:1}``, read as they stream:
:class:`Gemma4Reader` translates the syntax to JSON character by character."""

from __future__ import annotations

import json

import regex

from .calls import Args, CallReader, Dropped, End, Name, Piece, Unparsed, mlx_parser, whole_pieces
from .jsonstream import JsonPrefix

_CALL, _VALUE, _BROKEN, _DRAIN = range(4)

_QUOTE = '<|"|>'


class Gemma4Reader(CallReader):
    """Gemma 4's ``call:NAME{key:<|"|>text<|"|>,n:1,o:{...}}``, translated to JSON as it
    streams: bare keys quoted, ``<|"|>`` strings as JSON strings; several calls may follow.
    Strings the model opened with a plain ``"`` (JSON, passed on) or ``'`` (closed by ``'`` or
    ``<|"|>``) are read too: both slips are in recorded outputs (tests/chat/corpus/gemma4.json)."""

    _HEAD = regex.compile(r"\s*call:(?P<name>[\w.-]+)(?=\{)", regex.DOTALL)

    def __init__(self, tools: list[dict]) -> None:
        self.whole = mlx_parser("gemma4", tools)
        self.buf, self.state, self.calls = "", _CALL, 0
        self.json: JsonPrefix | None = None
        self.word = ""
        self.in_str: str | None = None  # "q": in <|"|>...<|"|>; "'" or '"': in a slipped quote
        self.escape = False
        self.stack: list[str] = []
        self.last = ""  # the last structural character passed to the JSON side
        self.raw = ""  # the current call's arguments as written, so far
        self.problem: str | None = None

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while self.buf and self.state in (_CALL, _VALUE, _BROKEN):
            if self.state == _BROKEN:
                out.append(Args(self.buf, valid=False))
                self.buf = ""
            elif self.state == _CALL:
                m = self._HEAD.match(self.buf, partial=True)
                if m is None or m.partial:
                    if m is None:
                        self.state = _DRAIN
                    break
                self.buf = self.buf[m.end():]
                self.json, self.state, self.stack, self.last = JsonPrefix(True), _VALUE, [], ""
                self.raw, self.word, self.in_str = "", "", None
                out.append(Name(m.group("name")))
            else:
                self._translate(out)
                if self.state == _VALUE:  # else the call ended (or broke): on with the rest
                    break
        return out

    def _translate(self, out: list[Piece]) -> None:
        """Translate what the buffer holds; each piece of JSON goes to the JSON side with the
        offset of the text it came from, so text that breaks it is passed on as written."""
        i, buf, base = 0, self.buf, len(self.raw)
        steps: list[tuple[int, str]] = []  # (offset in self.raw where it began, JSON text)
        while i < len(buf):
            at = base + i
            quote = buf.startswith(_QUOTE, i)
            if not quote and buf[i] == "<" and _QUOTE.startswith(buf[i:]):
                break  # maybe a delimiter: wait for more
            kind = self.in_str
            if kind == "'" and buf[i] == "'":  # ends before <|"|>, "," or "}"; else text
                nxt = buf[i + 1:i + 1 + len(_QUOTE)]
                if not nxt or (_QUOTE.startswith(nxt) and len(nxt) < len(_QUOTE)):
                    break  # cannot tell yet
                if nxt.startswith(_QUOTE) or nxt[0] in ",}":
                    steps.append((at, '"'))
                    self.in_str = None
                    i += 1 + (len(_QUOTE) if nxt.startswith(_QUOTE) else 0)
                    continue
            if quote and kind != '"':
                self._word(steps, at)
                steps.append((at, '"'))
                self.in_str, i = (None if kind else "q"), i + len(_QUOTE)
                continue
            ch = buf[i]
            i += 1
            if kind == '"':  # a plain JSON string: passed on as written
                steps.append((at, ch))
                self.escape = not self.escape and ch == "\\"
                if ch == '"' and not self.escape:
                    self.in_str = None
            elif kind:
                steps.append((at, json.dumps(ch, ensure_ascii=False)[1:-1]))
            elif ch in "'\"" and not self.word:  # a string in another quote (models slip)
                steps.append((at, '"'))
                self.in_str, self.escape = ch, False
            elif ch.isalnum() or ch in "_-.+":
                self.word += ch
            elif ch == ":" and self.word and self.last in ("{", ",") and self.stack[-1:] == ["{"]:
                steps.append((at - len(self.word), json.dumps(self.word) + ":"))
                self.word, self.last = "", ":"
            else:
                self._word(steps, at)
                if ch in "{[":
                    self.stack.append(ch)
                elif ch in "}]" and self.stack:
                    self.stack.pop()
                if not ch.isspace():
                    self.last = ch
                steps.append((at, ch))
                if not self.stack:
                    break  # the call's arguments are complete
        self.raw += buf[:i]
        self.buf = buf[i:]
        self._pass_on(steps, out)

    def _pass_on(self, steps: list[tuple[int, str]], out: list[Piece]) -> None:
        assert self.json is not None
        for at, js in steps:
            held = self.json.pending
            text, _ = self.json.feed(js)
            if text:
                out.append(Args(text))
            if self.json.error:  # from here on the text as written
                self.state, self.problem = _BROKEN, f"invalid_json: {self.json.error}"
                self.buf = held + self.raw[at:] + self.buf
                self.word = ""
                return
            if self.json.done:
                out.append(End())
                self.calls += 1
                self.state = _CALL
                return

    def _word(self, steps: list[tuple[int, str]], at: int) -> None:
        if self.word:
            steps.append((at - len(self.word), self.word))
            self.word, self.last = "", "v"

    def close(self, closed: bool) -> list[Piece]:
        out: list[Piece] = []
        if self.state == _VALUE:
            out.append(End("truncated" if not closed else "invalid_json: the arguments end "
                           "before they are complete"))
        elif self.state == _BROKEN:
            out.append(End(self.problem))
        elif self.buf.strip():
            out += whole_pieces(self.whole, self.buf, closed) if self.calls == 0 \
                else [Unparsed(self.buf) if closed else Dropped(self.buf)]
        self.buf = ""
        return out
