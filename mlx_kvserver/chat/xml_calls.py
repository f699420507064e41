"""Call readers for formats whose arguments are parameters as tags: Qwen3-Coder and Qwen3.5-3.6,
GLM 4.5-4.7, MiniMax M2 (Gemma 4's ``call:name{key:<|"|>v<|"|>}``: :mod:`.gemma_calls`).

:class:`XmlCallsReader` builds the arguments' JSON as the tags arrive: ``{"key": `` when a
parameter opens; a value the tool's schema types as a string (or that the format reads as one)
streams character by character as a JSON string; any other value is typed when its closing tag
arrives, by the format's own rules (the rules of mlx-lm's parser for that format: Qwen's by the
schema's type, GLM's by JSON then Python literals, MiniMax's by the schema's types in order).
"""

from __future__ import annotations

import ast
import json
from typing import Any

import regex

from .calls import Args, CallReader, Dropped, End, Name, Piece, Unparsed, mlx_parser, whole_pieces

# per format: call head (group name), parameter head (group key), value end, call end (None:
# the block holds one call), how a value's surrounding whitespace is trimmed, typing style
XML_FORMATS: dict[str, dict[str, Any]] = {
    "qwen3_coder": dict(call=r"\s*<function=(?P<name>[^>\n]+)>",
                        param=r"\s*<parameter=(?P<key>[^>\n]+)>", value_end="</parameter>",
                        call_end=r"\s*</function>", trim="newline", style="qwen", strict_end=True),
    "glm47": dict(call=r"\s*(?P<name>[^<\s][^<\n]*?)\s*(?:\n|(?=<))",
                  param=r"\s*<arg_key>(?P<key>[^<]*)</arg_key>\s*<arg_value>",
                  value_end="</arg_value>", call_end=None, trim="none", style="glm",
                  strict_end=False),
    "minimax_m2": dict(call=r'\s*<invoke name="?(?P<name>[^">]+)"?>',
                       param=r'\s*<parameter name="?(?P<key>[^">]+)"?>', value_end="</parameter>",
                       call_end=r"\s*</invoke>", trim="all", style="minimax", strict_end=False),
}
# NOTE strict_end: a value's end tag counts only where a parameter of the tool's schema (or the
# call's end) follows it, as Qwen3-Coder's own parser reads it: a file being written may hold the
# tags themselves. Elsewhere the first end tag ends the value (their parsers' rule; models there
# also name parameters the schema lacks).
XML_FORMATS["laguna"] = XML_FORMATS["glm47"]

_CALL, _PARAMS, _VALUE, _BROKEN, _DRAIN = range(5)


class XmlCallsReader(CallReader):
    def __init__(self, parser: str, tools: list[dict]) -> None:
        f = XML_FORMATS[parser]
        self.call_re = regex.compile(f["call"], regex.DOTALL)
        self.param_re = regex.compile(f["param"], regex.DOTALL)
        self.end_re = regex.compile(f["call_end"], regex.DOTALL) if f["call_end"] else None
        self.value_end, self.trim, self.style = f["value_end"], f["trim"], f["style"]
        self.strict_end = f["strict_end"]
        self.whole = mlx_parser(parser, tools)
        self.tools = {t["function"]["name"]: t["function"].get("parameters") or {}
                      for t in tools if isinstance(t.get("function"), dict)}
        self.state, self.buf = _CALL, ""
        self.props: dict = {}
        self.params = 0
        self.key = ""
        self.value = ""  # the open value's text not yet passed on
        self.as_string = False
        self.lead = True  # the open value has not begun (leading whitespace is trimmed)
        self.problem: str | None = None
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while self.buf and self.state not in (_DRAIN,):
            if self.state == _BROKEN:
                out.append(Args(self.buf, valid=False))
                self.buf = ""
            elif self.state == _CALL:
                m = self.call_re.match(self.buf, partial=True)
                if m is None:  # not this format's call: parsed whole at the end
                    self.state = _DRAIN
                    break
                if m.partial:
                    break
                self.buf = self.buf[m.end():]
                name = m.group("name").strip()
                self.props = (self.tools.get(name) or {}).get("properties") or {}
                self.state, self.params = _PARAMS, 0
                out.append(Name(name))
            elif self.state == _PARAMS:
                if not self._params(out):
                    break
            elif not self._value(out):
                break
        return out

    def _params(self, out: list[Piece]) -> bool:
        m = self.param_re.match(self.buf, partial=True)
        e = self.end_re.match(self.buf, partial=True) if self.end_re else None
        if (m is not None and m.partial) or (e is not None and e.partial):
            return False
        if m is not None:
            self.buf, self.key = self.buf[m.end():], m.group("key").strip()
            self.as_string = _streams_as_string(self.props.get(self.key), self.style)
            head = ("{" if self.params == 0 else ", ") + json.dumps(self.key, ensure_ascii=False)
            out.append(Args(head + (': "' if self.as_string else ": ")))
            self.params += 1
            self.state, self.value, self.lead = _VALUE, "", True
            return True
        if e is not None:
            self.buf = self.buf[e.end():]
            self._end_call(out)
            return True
        self.problem = "invalid_markup: text between parameters"
        self.state = _BROKEN
        return True

    def _value(self, out: list[Piece]) -> bool:
        self.value += self.buf
        self.buf = ""
        i = self.value.find(self.value_end)
        while i >= 0:
            after = self.value[i + len(self.value_end):]
            ends = self._ends_value(after)
            if ends is None:  # cannot tell yet: hold from the tag on
                break
            if ends:
                self.buf, raw, self.value = after, self.value[:i], ""
                self._pass(raw, out, last=True)
                self.state = _PARAMS
                return True
            i = self.value.find(self.value_end, i + 1)
        if i >= 0:
            ready, self.value = self.value[:i], self.value[i:]
            if self.as_string:
                self._pass(ready, out, last=False)
            else:
                self.value = ready + self.value
            return False
        keep = _partial_suffix(self.value, self.value_end)
        ready, self.value = self.value[:len(self.value) - keep], self.value[len(self.value) - keep:]
        if self.as_string:
            self._pass(ready, out, last=False)
        else:
            self.value = ready + self.value
        return False

    def _ends_value(self, after: str) -> bool | None:
        """Whether a value's end tag followed by ``after`` ends the value: True where the next
        parameter of the tool (any, for a tool without a schema), the call's end or the block's
        end follows; None while ``after`` is too short to say."""
        if not after.strip():
            return None
        m = self.param_re.match(after, partial=True)
        e = self.end_re.match(after, partial=True) if self.end_re else None
        if (m is not None and m.partial) or (e is not None and e.partial):
            return None
        if m is not None:
            return not (self.strict_end and self.props) or m.group("key").strip() in self.props
        return e is not None or not self.strict_end

    def _pass(self, text: str, out: list[Piece], last: bool) -> None:
        """Pass on a string value's ``text`` (or a whole typed value when ``last``)."""
        if not self.as_string:
            out.append(Args(json.dumps(_typed(_trimmed(text, self.trim), self.props.get(self.key),
                                              self.style), ensure_ascii=False)))
            return
        if self.lead:
            if self.trim == "all":
                text = text.lstrip()
            if not text and not last:
                return
            if self.trim == "newline" and text.startswith("\n"):
                text = text[1:]
            self.lead = False
        if not last:  # hold what the value's trimming may still take off its end
            held = _trailing(text, self.trim)
            text, self.value = text[:len(text) - len(held)], held + self.value
        else:
            text = _trimmed_end(text, self.trim)
        if text:
            out.append(Args(json.dumps(text, ensure_ascii=False)[1:-1]))
        if last:
            out.append(Args('"'))

    def _end_call(self, out: list[Piece], problem: str | None = None) -> None:
        out.append(Args("}" if self.params else "{}"))
        out.append(End(problem))
        self.calls += 1
        self.state = _CALL if self.end_re is not None else _DRAIN

    def close(self, closed: bool) -> list[Piece]:
        out: list[Piece] = []
        st, rest = self.state, self.buf
        self.buf = ""
        if st == _CALL and rest.strip():
            if self.style == "glm" and closed and regex.fullmatch(r"\s*[^<\s][^<\n]*\s*", rest):
                out += [Name(rest.strip()), Args("{}"), End()]  # a call without arguments
            elif self.calls == 0 and closed:  # cut off in the head: no name to call
                out += whole_pieces(self.whole, rest, closed)
            else:
                out.append(Unparsed(rest) if closed else Dropped(rest))
        elif st == _DRAIN and rest.strip():
            out += whole_pieces(self.whole, rest, closed) if self.calls == 0 \
                else [Unparsed(rest)]
        elif st == _PARAMS:
            if closed:
                self._end_call(out)
            else:
                out.append(End("truncated"))
        elif st == _VALUE:
            value = self.value + rest
            i = value.rfind(self.value_end)
            if closed and i >= 0 and not value[i + len(self.value_end):].strip():
                self._pass(value[:i], out, last=True)  # the last end tag ended the value
                self._end_call(out)
            elif closed:  # the block ended inside a value: what was written is the value
                self._pass(value, out, last=True)
                self._end_call(out, "invalid_markup: a parameter is not closed")
            else:
                out.append(End("truncated"))
        elif st == _BROKEN:
            out.append(End(self.problem))
        return out


def _streams_as_string(prop: Any, style: str) -> bool:
    if prop is None:  # a parameter the schema does not name
        return style in ("qwen", "minimax")
    return isinstance(prop, dict) and str(prop.get("type", "")).lower() == "string"


def _trimmed(text: str, trim: str) -> str:
    if trim == "all":
        return text.strip()
    if trim == "newline":
        text = text[1:] if text.startswith("\n") else text
        return text[:-1] if text.endswith("\n") else text
    return text


def _trimmed_end(text: str, trim: str) -> str:
    if trim == "all":
        return text.rstrip()
    if trim == "newline" and text.endswith("\n"):
        return text[:-1]
    return text


def _trailing(text: str, trim: str) -> str:
    if trim == "all":
        return text[len(text.rstrip()):]
    if trim == "newline" and text.endswith("\n"):
        return "\n"
    return ""


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _types(prop: Any) -> list[str]:
    if not isinstance(prop, dict):
        return []
    t = prop.get("type")
    if isinstance(t, list):
        return [str(x).lower() for x in t]
    if t is not None:
        return [str(t).lower()]
    found: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in prop.get(key) or []:
            found += _types(sub)
    return found


def _typed(raw: str, prop: Any, style: str) -> Any:
    """A parameter's text as the value the format means (the rules of mlx-lm's parsers)."""
    if style == "glm":
        return _deserialize(raw)
    if raw.lower() == "null":
        return None
    if not isinstance(prop, dict):  # a parameter the schema does not name: a string
        return raw
    if style == "qwen":
        if prop.get("type") is None:
            value = _json_or(raw)
            return value if isinstance(value, (dict, list)) else raw
        types = [str(prop["type"]).lower()]
    else:
        types = _types(prop) or ["string"]
    for t in types:
        try:
            if t.startswith(("int", "uint", "long", "short", "unsigned")):
                f = float(raw)
                if f != int(f):
                    raise ValueError(raw)
                return int(f)
            if t.startswith(("num", "float")):
                f = float(raw)
                return int(f) if f == int(f) else f
            if t in ("boolean", "bool", "binary"):
                low = raw.strip().lower()
                if style == "minimax" and low not in ("true", "1", "yes", "on", "false", "0",
                                                      "no", "off"):
                    continue
                return low in ("true", "1", "yes", "on")
            if t in ("string", "str", "text", "varchar", "char", "enum"):
                return raw
            return _deserialize(raw)
        except (ValueError, SyntaxError, OverflowError):
            continue
    return _json_or(raw)


def _json_or(raw: str) -> Any:
    try:
        return json.loads(raw, strict=False)
    except ValueError:
        return raw


def _deserialize(raw: str) -> Any:
    try:
        return json.loads(raw, strict=False)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(raw)
        json.dumps(value)
        return value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw
