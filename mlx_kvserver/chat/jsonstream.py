"""One JSON value followed as it streams: :class:`JsonPrefix`.

A tool call's arguments reach the client as the model writes them (argument deltas token by
token), and every API needs what it passes on to stay usable: Anthropic's SDK parses the
accumulated ``partial_json`` after every delta and raises on text that no completion can make
valid. :class:`JsonPrefix` therefore passes on only text that is a prefix of some valid JSON
value, and says where the value ends:

- raw control characters inside strings (a literal newline in a code edit, the commonest slip of
  small models) are passed on escaped (``\\n``), as a lenient parser would read them;
- a number, a ``true``/``false``/``null`` and an escape sequence are held until complete, and a
  comma until what follows it begins, so a prefix never ends inside them;
- the first character that no valid value could have stops it (:attr:`error`); what the model
  wrote from there on is the caller's to keep.

With ``require_object`` the value must be an object (tool arguments are).
"""

from __future__ import annotations

import json
import re

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_WS = " \t\r\n"
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")

# lexical states
_VALUE, _KEY, _KEY_OR_CLOSE, _VALUE_OR_CLOSE, _COLON, _AFTER, _DONE = range(7)


class JsonPrefix:
    """Feed text with :meth:`feed`; it returns the text safe to pass on and how much of the input
    belonged to the value (the rest follows the value: the caller's). :attr:`done` once the value
    is complete, :attr:`error` (a reason) once the text can no longer be valid JSON."""

    def __init__(self, require_object: bool = False) -> None:
        self.require_object = require_object
        self.stack: list[str] = []  # open containers, "{" or "["
        self.state = _VALUE
        self.string: str | None = None  # "key" or "value" while inside a string
        self.escape = ""  # an escape sequence being read (held)
        self.atom = ""  # a number or literal being read (held)
        self.comma = ""  # a comma and the whitespace after it (held)
        self.started = False
        self.done = False
        self.error: str | None = None
        self.held = ""  # once in error: what it had consumed and not passed on
        self._ate = False  # the character that went wrong was taken into a held piece

    def feed(self, text: str) -> tuple[str, int]:
        """(text to pass on, characters of ``text`` consumed). Fewer than ``len(text)`` are
        consumed only when the value ended (:attr:`done`) or the text went wrong (:attr:`error`):
        the rest is not part of the value."""
        out: list[str] = []
        for i, ch in enumerate(text):
            if self.done or self.error:
                return "".join(out), i
            self._char(ch, out)
            if self.error:
                held = self.comma + self.escape + self.atom
                self.held = held[:-1] if self._ate else held
                return "".join(out), i
        return "".join(out), len(text)

    def finish(self) -> str:
        """The input ended: a number or literal held at the top level completes the value."""
        if self.atom and not self.stack and not self.error:
            out: list[str] = []
            self._end_atom(out)
            return "".join(out)
        return ""

    @property
    def pending(self) -> str:
        """Text taken in and held (an unfinished number, literal, escape or comma)."""
        return self.comma + self.escape + self.atom

    def closing(self) -> str:
        """Text that makes what was passed on a complete value (``""`` once :attr:`done`): an
        open string closed, a missing value as ``null``, open containers closed. It shows that
        what was passed on is a JSON prefix (the tests check it); it is never added to a tool
        call's arguments, which hold only what the model wrote (``call_events.py``)."""
        if self.done or not self.started:
            return ""
        s = ""
        if self.string == "value":
            s += '"'
        elif self.string == "key":
            s += '": null'
        elif self.state == _COLON:
            s += ": null"
        elif self.state == _VALUE and self.stack and not self.comma:
            s += "null"
        return s + "".join("}" if c == "{" else "]" for c in reversed(self.stack))

    # -- internals --

    def _char(self, ch: str, out: list[str]) -> None:
        if self.string is not None:
            self._in_string(ch, out)
            return
        if self.atom:
            if ch in _NUMBER_CHARS and self.atom[0] not in "tfn" or \
                    self.atom[0] in "tfn" and ch.isalpha():
                self.atom += ch
                if self.atom[0] in "tfn" and not any(w.startswith(self.atom) for w in _LITERALS):
                    self.error, self._ate = f"not a JSON value: {self.atom!r}", True
                return
            self._end_atom(out)
            if self.error or self.done:
                return
        if ch in _WS:
            if self.comma:
                self.comma += ch
            elif self.started:
                out.append(ch)
            return
        if not self.started:
            if self.require_object and ch != "{":
                self.error = "the arguments are not a JSON object"
                return
            self.started = True
        st = self.state
        if st == _AFTER:
            if ch == "," and self.stack:
                self.comma = ","
                self.state = _KEY if self.stack[-1] == "{" else _VALUE
            elif ch in "}]" and self.stack and ch == ("}" if self.stack[-1] == "{" else "]"):
                self._close(ch, out)
            else:
                self.error = f"unexpected {ch!r} after a value"
            return
        if st in (_KEY, _KEY_OR_CLOSE):
            if ch == '"':
                self._flush_comma(out)
                self.string = "key"
                out.append(ch)
            elif ch == "}" and st == _KEY_OR_CLOSE:
                self._close(ch, out)
            else:
                self.error = f"unexpected {ch!r} where a key belongs"
            return
        if st == _COLON:
            if ch == ":":
                self.state = _VALUE
                out.append(ch)
            else:
                self.error = f"unexpected {ch!r} where ':' belongs"
            return
        # a value (or, right after "[", the array's end)
        if ch == "]" and st == _VALUE_OR_CLOSE:
            self._close(ch, out)
            return
        self._flush_comma(out)
        if ch in "{[":
            self.stack.append(ch)
            self.state = _KEY_OR_CLOSE if ch == "{" else _VALUE_OR_CLOSE
            out.append(ch)
        elif ch == '"':
            self.string = "value"
            out.append(ch)
        elif ch in "-0123456789" or ch in "tfn":
            self.atom = ch
        else:
            self.error = f"unexpected {ch!r} where a value belongs"

    def _in_string(self, ch: str, out: list[str]) -> None:
        if self.escape:
            self.escape += ch
            if len(self.escape) == 2 and ch not in _ESCAPES or \
                    self.escape[1:2] == "u" and len(self.escape) > 2 and ch not in _HEX:
                self.error, self._ate = f"bad escape {self.escape!r}", True
            elif len(self.escape) == 2 and ch != "u" or len(self.escape) == 6:
                out.append(self.escape)
                self.escape = ""
            return
        if ch == "\\":
            self.escape = ch
        elif ch == '"':
            out.append(ch)
            self.state = _COLON if self.string == "key" else _AFTER
            self.string = None
            if self.state == _AFTER and not self.stack:
                self.done = True
        elif ch < " ":
            out.append(json.dumps(ch)[1:-1])  # a raw control character: passed on escaped
        else:
            out.append(ch)

    def _end_atom(self, out: list[str]) -> None:
        atom = self.atom
        if not (atom in _LITERALS or _NUMBER.fullmatch(atom)):
            self.error = f"not a JSON value: {atom!r}"
            return
        self.atom = ""
        out.append(atom)
        self.state = _AFTER
        if not self.stack:
            self.done = True

    def _flush_comma(self, out: list[str]) -> None:
        if self.comma:
            out.append(self.comma)
            self.comma = ""

    def _close(self, ch: str, out: list[str]) -> None:
        self.stack.pop()
        out.append(ch)
        self.state = _AFTER
        if not self.stack:
            self.done = True

