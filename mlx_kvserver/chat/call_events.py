"""A choice's tool calls as events: :class:`CallTracker` turns a reader's pieces
(:mod:`.calls`) into ``ToolCallStart`` / ``ToolCallDelta`` / ``ToolCallEnd``, gives each call its
id, checks it, and decides which calls the answer holds and when no more may follow.

A call the answer holds (:attr:`CallTracker.calls`, what a client may run) is complete and its
arguments are a JSON object, as the model wrote them: nothing is ever added to them. What a
client gets for a call the model wrote badly (never a 500; each one logged and counted in
``/metrics`` by its problem):

- ``truncated`` (``max_tokens`` cut it) and ``invalid_json`` (arguments that are not a JSON
  object): not a call of the answer (only in :attr:`CallTracker.read`). The answer's first call
  streams as the model writes it, so a client streaming has seen its start and the valid part
  of its arguments (the deltas marked ``valid`` are a JSON prefix, the rest is the text as
  written) and gets its ``ToolCallEnd`` with the problem; a later call is held back until it is
  complete (below), so of one cut off or broken nothing is sent;
- ``unknown_tool`` (a name not offered) and ``schema`` (arguments that do not fit the tool's
  parameters): the call as written;
- ``invalid_markup``: tags a format's call did not close, the arguments as read;
- ``unparsed``: a closed call block with no call in it: its text goes back into the answer;
- ``dropped``: a block cut off before the tool's name: nothing that can be called.

Calls after the answer's first complete one are held back until they end: a call that
``max_tokens`` cuts after complete ones is never sent (an agent would run what it got), and the
answer ends with the complete calls (``finish_reason`` ``tool_calls``: see
``OutputParser.finish_reason``). Duplicates: a call with the same name and arguments as an
earlier call of the same answer is never passed on; it ends the answer (a weak model repeats a
forced call until ``max_tokens``; an agent would run each copy). With ``parallel`` False the
answer ends after its first call.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass, field

import jsonschema

from .calls import Args, Dropped, End, Name, Piece, Unparsed
from .conversation import Tool, ToolCall
from .output import Delta, ToolCallDelta, ToolCallEnd, ToolCallStart

log = logging.getLogger("mlx_kvserver.tools")


def new_call_id() -> str:
    """A fresh tool-call id, ``call_<24 hex digits>``."""
    return f"call_{secrets.token_hex(12)}"


@dataclass
class _Open:
    number: int
    id: str
    name: str
    args: str = ""
    held: list[Delta] = field(default_factory=list)
    holding: bool = False  # after a complete call: sent only once complete
    skip: bool = False  # a call after the answer ended: not passed on


class CallTracker:
    """Tool-call events of choice ``index``; :meth:`take` the pieces of its call blocks."""

    def __init__(self, index: int, tools: list[Tool], parallel: bool = True) -> None:
        self.index, self.parallel = index, parallel
        self.tools = {t.name: t for t in tools}
        self.calls: list[ToolCall] = []  # the answer's calls: complete, arguments an object
        self.read: list[ToolCall] = []  # every call that ended, in order, the answer's or not
        self.problems: list[str] = []  # every problem met, in order
        self.ended = False  # no further call may follow
        self._open: _Open | None = None
        self._numbers = 0  # calls whose start went out (their numbers in the stream)
        self._validators: dict[str, jsonschema.protocols.Validator | None] = {}

    def take(self, pieces: list[Piece]) -> tuple[list[Delta], list[str]]:
        """(deltas, texts given back to the answer) for ``pieces``."""
        out: list[Delta] = []
        back: list[str] = []
        for p in pieces:
            if isinstance(p, Name):
                self._start(p.name, out)
            elif isinstance(p, Args) and self._open is not None:
                self._args(p, out)
            elif isinstance(p, End) and self._open is not None:
                self._end(p.problem, out)
            elif isinstance(p, Unparsed):
                self._problem(None, "unparsed: a tool-call block with no call in it: "
                              f"{_brief(p.text)}", out)
                back.append(p.text)
            elif isinstance(p, Dropped):
                self._problem(None, f"dropped: cut off before the tool's name: {_brief(p.text)}",
                              out)
        return out, back

    def _start(self, name: str, out: list[Delta]) -> None:
        c = _Open(self._numbers, new_call_id(), name, skip=self.ended)
        c.holding = not c.skip and bool(self.calls)
        if not c.skip and not c.holding:
            self._numbers += 1
        self._open = c
        self._emit(c, ToolCallStart(self.index, c.number, c.id, name), out)

    def _args(self, p: Args, out: list[Delta]) -> None:
        c = self._open
        assert c is not None
        c.args += p.text
        self._emit(c, ToolCallDelta(self.index, c.number, p.text, p.valid), out)

    def _end(self, problem: str | None, out: list[Delta]) -> None:
        c, self._open = self._open, None
        assert c is not None
        if c.skip:
            return
        if c.holding and any(k.name == c.name and k.arguments == c.args for k in self.calls):
            log.info("a repeated call of %s ended the answer (not passed on)", c.name)
            self.ended = True
            return
        problem = problem or self._check(c.name, c.args)
        call = ToolCall(c.id, c.name, c.args, problem)
        self.read.append(call)
        if not runnable(call):
            # held: nothing of it went out; streamed: its end says why it is not a call
            self._problem(None if c.holding else c.number, problem, out)
            self.ended = self.ended or not self.parallel
            return
        if c.holding:
            c.holding = False
            out += c.held
            self._numbers += 1
        self.calls.append(call)
        self._problem(c.number, problem, out)
        if not self.parallel:
            self.ended = True

    def _problem(self, number: int | None, problem: str | None, out: list[Delta]) -> None:
        if problem is not None:
            self.problems.append(problem)
            log.warning("tool call %s: %s", "-" if number is None else number, problem)
        if number is not None or problem is not None:
            out.append(ToolCallEnd(self.index, -1 if number is None else number, problem))

    def _emit(self, c: _Open, d: Delta, out: list[Delta]) -> None:
        if not c.skip:
            (c.held if c.holding else out).append(d)

    def _check(self, name: str, args: str) -> str | None:
        try:
            value = json.loads(args)
        except ValueError as e:
            return f"invalid_json: {e}"
        if not isinstance(value, dict):
            return "invalid_json: the arguments are not a JSON object"
        if name not in self.tools:
            return f"unknown_tool: {name!r} is not among the tools offered"
        v = self._validator(name)
        if v is not None:
            err = jsonschema.exceptions.best_match(v.iter_errors(value))
            if err is not None:
                return f"schema: {err.message[:200]}"
        return None

    def _validator(self, name: str):
        if name not in self._validators:
            schema = self.tools[name].parameters
            try:
                cls = jsonschema.validators.validator_for(schema)
                cls.check_schema(schema)
                self._validators[name] = cls(schema)
            except Exception:  # noqa: BLE001 - a schema we cannot check with: no check
                self._validators[name] = None
        return self._validators[name]


def runnable(call: ToolCall) -> bool:
    """Whether ``call`` can be part of an answer: complete (not cut off by ``max_tokens``) and
    its arguments a JSON object."""
    if call.problem == "truncated":
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except ValueError:
        return False


def _brief(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 120 else text[:117] + "..."
